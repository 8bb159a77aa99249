"""The compiler's back half: compile() as a recipe (driver.py), the pass driver, stage building,
lowering of the per-rank schedules, input windows, the pass report and prediction's region
compilation (predict.py, receptive.py). It runs the passes (fxpar.passes) on what the frontend
captured and emits a fxpar.program.Program; the cost model and simulator it consults are in
fxpar.perf."""

"""The compiler's back half: compile() as a recipe (driver.py), the pass driver, stage building,
lowering and simulation of the per-rank schedules, input windows, memory estimates, reports and
pictures. It runs the passes (fxpar.passes) on what the frontend captured."""

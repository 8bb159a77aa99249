"""Performance models under the compiler: the cost model (costmodel.py) over measured device
profiles (profile.py, profiles/), the schedule simulator (simulate.py) and memory estimates
(memory.py, which chooses the stages to recompute)."""

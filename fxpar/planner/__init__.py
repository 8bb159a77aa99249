"""Choosing a plan (above the compiler, which it runs): the plan space and its search
(planspace.py, planner.py: ``fxpar.plan_auto``) and calibration of a device profile by
timing compiled programs (calibrate.py)."""

"""Training a rank program: :class:`~fxpar.train.trainer.Trainer`, configured by
:class:`~fxpar.train.config.TrainConfig` (what ``fxpar-run`` parses its flags into), with
validation (evaluate.py), metrics files (metrics.py), LR schedules (schedules.py), a moving
average of the weights (ema.py) and what both add around each optimizer step (recipe.py)."""

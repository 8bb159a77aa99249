"""Training a rank program: :class:`~fxpar.train.trainer.Trainer`, configured by
:class:`~fxpar.train.trainer.TrainConfig` (what ``fxpar-run`` parses its flags into), with
validation (evaluate.py) and metrics files (metrics.py)."""

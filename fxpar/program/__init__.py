"""The compiled program, in memory and on disk: :class:`~fxpar.program.program.Program` (the
whole job) and :class:`~fxpar.program.rank.RankProgram` (one rank's share, bound to parameters
and a communicator); saving and loading them as data (emit.py, graphdata.py, loader.py,
layout.py); checkpoints (checkpoint.py, checkpoint_folder.py, integrity.py); a rank's groups
and how a tiled output computes the loss (groups.py, tileloss.py)."""

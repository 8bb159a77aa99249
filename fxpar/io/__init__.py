"""The compiled program as an object and on disk: Program / RankProgram (program.py), saving and
loading per-rank programs (emit.py, loader.py, layout.py), checkpoints, data and metrics."""

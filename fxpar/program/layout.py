"""The folder layout of a saved program (written by fxpar.program.emit, read by
fxpar.program.loader)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fxpar.core.plan import PlanError

FORMAT = 2
"""The version of the saved layout (program.json's "fxpar_program"). 2: each stage has
``graph.json``, which the loader builds it from (1: the loader imported ``module.py``)."""


def rank_folder(rank: int) -> str:
    return f"rank{rank:05d}"


def stage_folder(copy: int, stage: int) -> str:
    return f"c{copy}_s{stage}"


def read_program(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """program.json of a saved program, checked."""
    path = Path(folder) / "program.json"
    if not path.is_file():
        raise PlanError(f"{folder} is not a saved fxpar program (no program.json): write one "
                        f"with program.save(folder)")
    info = json.loads(path.read_text())
    if info.get("fxpar_program") != FORMAT:
        raise PlanError(f"{path} has format {info.get('fxpar_program')!r}; this fxpar "
                        f"reads format {FORMAT}: save the program again")
    return info

"""A case that deadlocks on purpose: both ranks receive first (tests the harness timeout)."""

import torch

from fxpar.comm.world import world


def case_hang() -> None:
    c = world()
    c.recv(torch.empty(1), 1 - c.rank)

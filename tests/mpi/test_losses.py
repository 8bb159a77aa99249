"""The loss users train with, on tiled outputs (issue 36): which losses run their reductions on
tiles, what happens to one that cannot, and the transparency of each under a real mpiexec
(tests/mpi/cases/loss_cases.py: loss, every gradient, parameters after 2 steps, every buffer vs one
process, float64)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from cases.loss_cases import LOSSES, SHAPES, SegNet, targets
from helpers.launch import Batch, cases_in, check

import fxpar
from fxpar.compiler.loss import LossWarning, tiled_loss
from fxpar.core.geometry import Grid
from fxpar.core.plan import PlanError
from fxpar.frontend.loss import capture_loss

CASES, NAMES = cases_in("loss_cases.py")
GRIDS = {2: [Grid(2, 1), Grid(1, 2), Grid(2, 2), Grid(3, 1)], 3: [Grid(2, 2, 2), Grid(3, 1, 1)]}


def _specs(loss: str, dims: int):
    shape = (2, *SHAPES[dims][1:])
    y = targets(LOSSES[loss][1], shape)(torch.Generator().manual_seed(0))
    ys = y if isinstance(y, tuple) else (y,)
    return ((2, 3, *shape[2:]), torch.float64), [(tuple(t.shape), t.dtype) for t in ys]


@pytest.mark.parametrize("loss", [name for name in LOSSES if not name.startswith("joined")])
def test_library_losses_run_their_reductions_on_tiles(loss):
    for dims, grids in GRIDS.items():
        out, ys = _specs(loss, dims)
        loss_fn = LOSSES[loss][0]()
        captured = capture_loss(loss_fn, out, ys)  # one capture, analysed on every grid
        for grid in grids:
            with warnings.catch_warnings():
                warnings.simplefilter("error", LossWarning)
                made = tiled_loss(loss_fn, grid, 0, True, out, ys, captured=captured)
            assert made.joined == "", (grid, made.joined)
            assert all(made.sliced), "every per-pixel target is cut to the tile"


def test_an_op_without_a_rule_joins_the_output_and_says_which_and_where():
    out, ys = _specs("joined_cumsum", 2)
    with pytest.warns(LossWarning, match=r"aten\.cumsum in the loss cumsum_loss "
                       r"\(.*loss_cases\.py:\d+\): it works along dim 2, which is split"):
        made = tiled_loss(LOSSES["joined_cumsum"][0](), Grid(2, 1), 0, False, out, ys)
    assert made.joined and made.sliced == (True,)
    # along W, which a horizontal split leaves whole, the running sum has a rule
    made = tiled_loss(lambda o, y: o.cumsum(3).mean(), Grid(2, 1), 0, True, out, ys)
    assert made.joined == ""


def test_strict_plans_refuse_to_join_the_output():
    out, ys = _specs("joined_cumsum", 2)
    with pytest.raises(PlanError,
                       match=r"aten\.cumsum in the loss cumsum_loss \(.*\): .*strict=True"):
        tiled_loss(LOSSES["joined_cumsum"][0](), Grid(2, 1), 0, True, out, ys)


def test_a_loss_that_cannot_be_captured_is_joined_with_the_reason():
    def branchy(o, y):
        if (o > 0).any():  # Python control flow on a tensor's value: no single graph
            return F.cross_entropy(o, y)
        return o.mean()

    out, ys = _specs("ce", 2)
    with pytest.warns(LossWarning, match="torch.export could not capture the loss branchy"):
        made = tiled_loss(branchy, Grid(2, 1), 0, False, out, ys)
    assert "could not capture" in made.joined


def test_compile_with_an_example_target_checks_the_loss_there():
    model = SegNet(2).double()
    x = torch.empty(SHAPES[2], dtype=torch.float64, device="meta")
    y = torch.empty((SHAPES[2][0], *SHAPES[2][2:]), dtype=torch.int64, device="meta")
    plan = fxpar.Plan(spatial_parts=2, slice="horizontal")  # the running sum is down the rows
    with pytest.warns(LossWarning, match="cumsum"):
        fxpar.compile(model, plan, x, loss_fn=LOSSES["joined_cumsum"][0](), target=y)
    with pytest.raises(PlanError, match="cumsum"):
        fxpar.compile(model, fxpar.Plan(spatial_parts=2, slice="horizontal", strict=True), x,
                      loss_fn=LOSSES["joined_cumsum"][0](), target=y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LossWarning)
        fxpar.compile(model, plan, x, loss_fn=LOSSES["monai_dice"][0](),
                      target=torch.empty((SHAPES[2][0], 1, *SHAPES[2][2:]), dtype=torch.int64))


BATCH = Batch(CASES, n=8 if any("cube8" in c for c in CASES) else 4, timeout=2400,
              share=True)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.mpi
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_loss_transparency(results, case):
    check(results, case)

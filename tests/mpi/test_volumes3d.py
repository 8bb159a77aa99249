"""3-D spatial parallelism under a real mpiexec (8 ranks), exact vs one process in float64
(tests/mpi/cases/volume_cases.py): every 3-D op class on slabs, pencils, cubes and uneven explicit
grids with odd sizes; the volume models (MONAI UNet / SegResNet / BasicUNet with
spatial_dims=3, the zoo's 3D U-Net and CosmoFlow), each under one plan, so that every plan
(1 rank, SP2 slabs, SP4 pencils, SP8 cube, SP2+PP2, SP2+DP2) runs on one of them; a 3D U-Net
under SP2+GEMS+PP, two spatial stages on pencils, and all five dimensions at once;
``FXPAR_VOLUME_MATRIX=1`` runs every (model, plan) pair. A zeroed corner piece is caught."""

import os

import pytest
from helpers.launch import Batch, cases_in, check

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(1800)]  # one 8-rank launch, minutes
ALL, NAMES = cases_in("volume_cases.py")


def ci_subset() -> list[str]:
    """Every op case on every grid, every stage/GEMS/DP combination, the mutation case; each
    whole model under one or two plans, so that every plan family appears on a library model:
    MONAI's UNet on slabs and under SP2+PP2, SegResNet on the cube, BasicUNet under SP2+DP2,
    the zoo's U-Net on pencils, CosmoFlow on slabs, on the cube and on one rank. The other
    (model, plan) pairs repeat those claims on another model: ``FXPAR_VOLUME_MATRIX=1`` (they
    took 128 s of the 8-rank launch, measured in one run of the whole suite)."""
    names = [n for n in NAMES if n.startswith(("case_op_", "case_combo_"))]
    names += [f"case_{m}__{p}" for m, p in CI_MODEL_PLANS]
    return names + ["case_zeroed_corner_piece_is_caught"]


CI_MODEL_PLANS = [("monai_UNet", "sp2_slab"), ("monai_UNet", "sp2_pp2"),
                  ("monai_SegResNet", "sp8_cube"), ("monai_BasicUNet", "sp2_dp2"),
                  ("unet3d", "sp4_pencil"), ("cosmoflow", "sp2_slab"), ("cosmoflow", "sp8_cube"),
                  ("cosmoflow", "one")]


CHOSEN = NAMES if os.environ.get("FXPAR_VOLUME_MATRIX") == "1" else ci_subset()
assert set(CHOSEN) <= set(NAMES), sorted(set(CHOSEN) - set(NAMES))
CASES = [c for c, n in zip(ALL, NAMES, strict=True) if n in CHOSEN]


BATCH = Batch(CASES, n=8, timeout=1800, share=True)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.parametrize("case", CASES, ids=[c.split("::")[1] for c in CASES])
def test_volume_transparency(results, case):
    check(results, case)

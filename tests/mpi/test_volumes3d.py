"""3-D spatial parallelism under a real mpiexec (8 ranks), exact vs one process in float64
(tests/mpi/cases/volume_cases.py): every 3-D op class on slabs, pencils, cubes and uneven explicit
grids with odd sizes; the volume models (MONAI UNet / SegResNet / BasicUNet with
spatial_dims=3, the zoo's 3D U-Net and CosmoFlow) under SP2 slabs and an SP8 cube each, and the
other plans (1 rank, SP4 pencils, SP2+PP2, SP2+DP2) on one model each, in turn; a 3D U-Net
under SP2+GEMS+PP, two spatial stages on pencils, and all five dimensions at once;
``FXPAR_VOLUME_MATRIX=1`` runs every (model, plan) pair. A zeroed corner piece is caught."""

import os

import pytest
from helpers.launch import Batch, cases_in, check

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(1800)]  # one 8-rank launch, minutes
ALL, NAMES = cases_in("volume_cases.py")


def ci_subset() -> list[str]:
    """Every op case and stage/GEMS/DP combination; every model under sp2_slab and sp8_cube;
    each other plan on one model (a different one each); the mutation case."""
    models = ["monai_UNet", "monai_SegResNet", "monai_BasicUNet", "unet3d", "cosmoflow"]
    names = [n for n in NAMES if n.startswith(("case_op_", "case_combo_"))]
    names += [f"case_{m}__{p}" for m in models for p in ("sp2_slab", "sp8_cube")]
    for k, plan in enumerate(("one", "sp4_pencil", "sp2_pp2", "sp2_dp2")):
        names.append(f"case_{models[(2 * k + 1) % len(models)]}__{plan}")
    return names + ["case_zeroed_corner_piece_is_caught"]


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

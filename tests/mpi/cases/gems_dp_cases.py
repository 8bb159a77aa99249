"""GEMS, data parallelism and their combinations vs one process (run by tests/mpi/test_gems_dp.py).
The reference is gradient accumulation over the same chunks, in replica, copy, round,
micro-batch order; both GEMS copies and all replicas must end identical to it."""

from unittest import mock

import torchvision.models as tvm
from helpers.models import resnet18_narrow
from helpers.transparency import Case, check

import fxpar
from fxpar import models
from fxpar.runtime import sync as sync_module


def _resnet18():
    """resnet18's structure at a sixteenth of the width (tests/helpers/models.py);
    torchvision's resnet18 runs in case_gems_lp_resnet18."""
    return resnet18_narrow()


def _resnet18_tv():
    return tvm.resnet18(num_classes=5)


def _amoebanet():
    return models.build("amoebanet", num_classes=5, num_layers=3, num_filters=16)


def _densenet():
    """torchvision's DenseNet with 2 layers per dense block (densenet121 has 6, 12, 24, 16): the
    same dense layers, concatenations and transitions at a sixth of the capture time
    (densenet121 itself is traced and split in tests/unit)."""
    return tvm.DenseNet(32, (2, 2, 2, 2), 64, num_classes=5)


def P(**kw):  # noqa: N802
    return fxpar.Plan(**kw)


def case_gems_lp_resnet18():
    # 8 images: each GEMS copy's micro-batch of 4 keeps layer4's BatchNorm (1x1 at 32x32)
    # well conditioned (with 2, one process's step-2 gradients move by 2.5e-3 for a 1e-15
    # change of the input)
    check(Case(_resnet18_tv, (8, 3, 32, 32), P(stages=2, gems=True)))


def case_gems_pp_times2_amoebanet():
    check(Case(_amoebanet, (16, 3, 32, 32), P(stages=2, microbatches=2, gems=True,
                                             gems_times=2, schedule="1f1b")))


def case_gems_odd_stages_densenet():
    check(Case(_densenet, (4, 3, 32, 32), P(stages=3, gems=True)))


def case_sp_gems_lp_resnet18():
    check(Case(_resnet18, (4, 3, 64, 64), P(stages=2, spatial_parts=2, gems=True)))


def case_sp_gems_pp_amoebanet():
    check(Case(_amoebanet, (8, 3, 64, 64), P(stages=2, spatial_parts=2, slice="horizontal",
                                             microbatches=2, gems=True)))


def case_sp_dp_resnet18():
    check(Case(_resnet18, (4, 3, 64, 64), P(spatial_parts=2, data_parallel=2)))


def case_lp_dp_densenet():
    # 64 KiB buckets: several per stage of this small net (4 MiB would make one, which can
    # only start with the stage's last gradient)
    with mock.patch.object(sync_module, "BUCKET_BYTES", 2**16):
        rp = check(Case(_densenet, (4, 3, 32, 32), P(stages=2, data_parallel=2)))
    if rp is not None:  # gradient sums started during backward, bucket by bucket
        (sync,) = rp.syncs
        assert len(sync.buckets) > 2, len(sync.buckets)
        assert sync.early >= max(1, len(sync.buckets) - 1), (sync.early, len(sync.buckets))
        # ... and the first one while backward was still producing gradients (not all of them
        # in a burst at its last one: buckets cut in the stage's forward order, reversed)
        total = len(sync.slots) * sync.expected
        assert sync.started_at[0] < total // 2, (sync.started_at, total)


def case_pp_dp_amoebanet():
    check(Case(_amoebanet, (8, 3, 32, 32), P(stages=2, microbatches=2, data_parallel=2,
                                             schedule="1f1b")))


def case_full_5d_resnet18():
    # 2 stages (stage 0 on 2 tiles) x GEMS x 2 replicas x 2 micro-batches: 6 ranks
    check(Case(_resnet18, (16, 3, 64, 64), P(stages=2, spatial_parts=2, slice="vertical",
                                              microbatches=2, gems=True, data_parallel=2)))


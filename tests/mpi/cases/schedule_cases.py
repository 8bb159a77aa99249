"""Zero-bubble and interleaved schedules vs one process (run by tests/mpi/test_schedules_mpi.py):
alone and with spatial stages, GEMS and data parallelism; float64, loss, every gradient,
parameters after 2 steps, buffers. A split backward must leave every weight gradient once:
a missing W or a W run twice shows up as O(|grad|) in the tensors of that stage."""

import torchvision.models as tvm
from helpers.models import resnet18_narrow
from helpers.transparency import Case, check

import fxpar
from fxpar import models


def _resnet18():
    """resnet18's structure at a sixteenth of the width (tests/helpers/models.py): the
    schedules move what any width moves; torchvision's resnet18 runs in
    case_zb_resnet18_pp2_m2. Its cases take 64x64 images: at 32x32 with micro-batches of 2,
    layer4's BatchNorm normalises 2 values per channel, and one process's own step-2
    gradients move by 1e-2 when the input moves by 1e-15 (measured; 8e-14 at 64x64)."""
    return resnet18_narrow()


ALL_SPATIAL = (12, 20, 20, 19)
"""Nodes per stage of the narrow resnet18 cut into 4 spatial stages. Balanced by FLOPs, its
7x7 stem (as costly as a block at this width) takes a stage and the last stage holds only the
head, which has no tiled work (a PlanError says so); this cut gives every stage convolutions."""


def _resnet18_tv():
    return tvm.resnet18(num_classes=5)


def _amoebanet():
    return models.build("amoebanet", num_classes=5, num_layers=3, num_filters=16)


def _unet():
    return models.build("unet", in_channels=3, num_classes=5, base_channels=4, depth=3)


def P(**kw):  # noqa: N802 - reads like the Plan it builds
    return fxpar.Plan(**kw)


def _weights_split(rp):
    """The schedule really split this rank's backwards (it has W actions)."""
    if rp is not None:
        assert any(a.kind == "W" for a in rp.program.schedule[rp.rank]), "no W action"


def case_zb_resnet18_pp2_m2():
    # micro-batches of 4: with 2 (8 images in 4), torchvision's resnet18 at 32x32 is as
    # ill-conditioned as the narrow one above (one process's step-2 gradients move by 1e-2
    # for a 1e-15 change of the input; 4e-11 with 4)
    _weights_split(check(Case(_resnet18_tv, (8, 3, 32, 32),
                              P(stages=2, microbatches=2, schedule="zero_bubble"))))


def case_zb_amoebanet_pp4_m4():
    _weights_split(check(Case(_amoebanet, (8, 3, 32, 32),
                              P(stages=4, microbatches=4, schedule="zero_bubble"))))


def case_zb_unet_skips_pp3_m2():
    _weights_split(check(Case(_unet, (4, 3, 16, 16),
                              P(stages=3, microbatches=2, schedule="zero_bubble"),
                              segmentation=True)))


def case_zb_sp2_pp2_resnet18():
    # stage 0 on 2 tiles: halo exchanges and BatchNorm statistics in B, none in W
    _weights_split(check(Case(_resnet18, (4, 3, 64, 64),
                              P(stages=2, spatial_parts=2, slice="vertical", microbatches=2,
                                schedule="zero_bubble"))))


def case_zb_sp2_two_spatial_stages_amoebanet():
    _weights_split(check(Case(_amoebanet, (4, 3, 48, 48),
                              P(stages=3, spatial_parts=2, spatial_stages=2, microbatches=2,
                                schedule="zero_bubble"))))


def case_zb_gems_pp2_amoebanet():
    _weights_split(check(Case(_amoebanet, (8, 3, 32, 32),
                              P(stages=2, microbatches=2, gems=True, schedule="zero_bubble"))))


def case_zb_dp2_pp2_resnet18():
    rp = check(Case(_resnet18, (8, 3, 64, 64),
                    P(stages=2, microbatches=2, data_parallel=2, schedule="zero_bubble")))
    _weights_split(rp)
    if rp is not None:  # W accumulates through autograd: the bucket sums start in backward
        (sync,) = rp.syncs
        assert sync.early >= 1, (sync.early, len(sync.buckets))
        if len(sync.buckets) > 1:  # the first sum started inside backward
            total = len(sync.slots) * sync.expected
            assert sync.started_at[0] < total, (sync.started_at, total)


def case_zb_recompute_pp2_resnet18():
    _weights_split(check(Case(_resnet18, (4, 3, 64, 64),
                              P(stages=2, microbatches=2, recompute="always",
                                schedule="zero_bubble"))))


def case_zb_5d_resnet18():
    # 2 stages (stage 0 on 2 tiles) x GEMS x 2 replicas x 2 micro-batches: 6 ranks
    _weights_split(check(Case(_resnet18, (16, 3, 64, 64),
                              P(stages=2, spatial_parts=2, slice="vertical", microbatches=2,
                                gems=True, data_parallel=2, schedule="zero_bubble"))))


def case_i1f1b_resnet18_4stages_on_2_ranks():
    rp = check(Case(_resnet18, (8, 3, 64, 64),
                    P(stages=4, stages_per_rank=2, microbatches=4, schedule="interleaved_1f1b")))
    if rp is not None:  # rank r holds stages r and r + 2
        assert sorted(s for _, s in rp.stages) == [rp.rank, rp.rank + 2]


def case_i1f1b_amoebanet_6stages_on_3_ranks_m3():
    check(Case(_amoebanet, (6, 3, 32, 32),
               P(stages=6, stages_per_rank=2, microbatches=3, schedule="interleaved_1f1b")))


def case_i1f1b_unet_skips():
    check(Case(_unet, (4, 3, 16, 16),
               P(stages=4, stages_per_rank=2, microbatches=2, schedule="interleaved_1f1b"),
               segmentation=True))


def case_i1f1b_all_spatial_sp2():
    # every stage on 2 tiles: 2 pipeline ranks x 2 tiles, each rank holding 2 stages' tiles
    check(Case(_resnet18, (4, 3, 64, 64),
               P(stages=4, stages_per_rank=2, spatial_parts=2, spatial_stages=4,
                 slice="vertical", microbatches=2, schedule="interleaved_1f1b",
                 balance=ALL_SPATIAL)))


def case_i1f1b_gems():
    check(Case(_amoebanet, (8, 3, 32, 32),
               P(stages=4, stages_per_rank=2, microbatches=2, gems=True,
                 schedule="interleaved_1f1b")))


def case_i1f1b_dp2():
    check(Case(_resnet18, (8, 3, 64, 64),
               P(stages=4, stages_per_rank=2, microbatches=2, data_parallel=2,
                 schedule="interleaved_1f1b")))


def case_zbv_resnet18_4stages_on_2_ranks():
    rp = check(Case(_resnet18, (8, 3, 64, 64),
                    P(stages=4, stages_per_rank=2, microbatches=4, schedule="zero_bubble_v")))
    _weights_split(rp)
    if rp is not None:  # a V: rank r holds stages r and 3 - r
        assert sorted(s for _, s in rp.stages) == sorted({rp.rank, 3 - rp.rank})


def case_zbv_unet_skips_6stages_m3():
    _weights_split(check(Case(_unet, (6, 3, 16, 16),
                              P(stages=6, stages_per_rank=2, microbatches=3,
                                schedule="zero_bubble_v"), segmentation=True)))


def case_zbv_all_spatial_sp2_gems():
    _weights_split(check(Case(_resnet18, (8, 3, 64, 64),
                              P(stages=4, stages_per_rank=2, spatial_parts=2, spatial_stages=4,
                                slice="vertical", microbatches=2, gems=True,
                                schedule="zero_bubble_v", balance=ALL_SPATIAL))))


def case_zbv_dp2():
    _weights_split(check(Case(_amoebanet, (8, 3, 32, 32),
                              P(stages=4, stages_per_rank=2, microbatches=2, data_parallel=2,
                                schedule="zero_bubble_v"))))

"""Layer and pipeline parallelism vs one process (run by tests/mpi/test_pipeline.py).

Dropout is off: its random masks are not part of the contract (each rank draws its own)."""

import torchvision.models as tvm
from helpers.models import resnet18_narrow
from helpers.transparency import Case, check

import fxpar
from fxpar import models


def _resnet18():
    return tvm.resnet18(num_classes=5)


def _resnet50():
    return tvm.resnet50(num_classes=5)


def _densenet():
    """torchvision's DenseNet with 2 layers per dense block (densenet121 has 6, 12, 24, 16): the
    same dense layers, concatenations and transitions at a sixth of the capture time
    (densenet121 itself is traced and split in tests/unit)."""
    return tvm.DenseNet(32, (2, 2, 2, 2), 64, num_classes=5)


def _googlenet():
    return tvm.googlenet(num_classes=5, aux_logits=False, init_weights=False, dropout=0.0)


def _mobilenet():
    return tvm.mobilenet_v3_small(num_classes=5, dropout=0.0)


def _amoebanet():
    return models.build("amoebanet", num_classes=5, num_layers=3, num_filters=16)


def _unet():
    return models.build("unet", in_channels=3, num_classes=5, base_channels=4, depth=3)


def P(**kw):  # noqa: N802 - reads like the Plan it builds
    return fxpar.Plan(**kw)


def case_resnet18_lp2():
    check(Case(_resnet18, (4, 3, 32, 32), P(stages=2)))


def case_resnet18_pp4_gpipe_s4():
    check(Case(resnet18_narrow, (8, 3, 64, 64), P(stages=4, microbatches=4, schedule="gpipe")))


def case_resnet18_pp2_1f1b_s3():
    check(Case(resnet18_narrow, (4, 3, 64, 64), P(stages=3, microbatches=2, schedule="1f1b")))


def case_resnet50_pp2_s2():
    check(Case(_resnet50, (4, 3, 32, 32), P(stages=2, microbatches=2, schedule="1f1b")))


def case_densenet_pp4_s3():
    check(Case(_densenet, (8, 3, 32, 32), P(stages=3, microbatches=4, schedule="1f1b")))


def case_googlenet_lp_s3():
    check(Case(_googlenet, (4, 3, 40, 40), P(stages=3)))


def case_mobilenet_pp2_s2_gpipe():
    check(Case(_mobilenet, (4, 3, 32, 32), P(stages=2, microbatches=2)))


def case_amoebanet_pp4_s4_1f1b():
    check(Case(_amoebanet, (8, 3, 32, 32), P(stages=4, microbatches=4, schedule="1f1b")))


def case_unet_skips_cross_two_cuts():
    rp = check(Case(_unet, (4, 3, 16, 16), P(stages=3, microbatches=2), segmentation=True))
    if rp is not None:
        assert max(t.dst - t.src for t in rp.program.graph.transfers) >= 2


def case_explicit_balance():
    rp = check(Case(_resnet18, (4, 3, 32, 32), P(stages=2, balance=(5, 64))))
    if rp is not None and rp.rank == 0:
        assert len([n for n in rp.stages[(0, 0)].graph.nodes
                    if n.op not in ("placeholder", "output", "get_attr")]) == 5

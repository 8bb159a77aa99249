"""Mixed precision (``Plan(precision=...)``): under a real mpiexec
(tests/mpi/cases/precision_cases.py) 5 steps vs one process under ``torch.autocast`` within one
process's own noise (bit-identical without spatial stages), a zeroed halo piece caught, fp16's loss
scale skipping a step on every
rank; here, without MPI: the plan field, the casts the precision pass writes into the graph,
messages in the compute dtype, float32 norm statistics and GradScaler's scale rule."""

import pytest
import torch
import torch.nn.functional as F
from helpers.launch import Batch, cases_in, check
from torch import nn

import fxpar
from fxpar.core import meta
from fxpar.core.meta import TensorInfo
from fxpar.core.plan import PlanError
from fxpar.runtime.scale import LossScale
from fxpar.runtime.spatial.moments import global_moments

CASES, NAMES = cases_in("precision_cases.py")
aten = torch.ops.aten


BATCH = Batch(CASES, n=4, timeout=900)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_precision_transparency(results, case):
    check(results, case)


def test_plan_field():
    assert fxpar.Plan().precision == "fp32"
    with pytest.raises(PlanError, match=r"Plan.precision must be one of \('fp32', 'bf16', "
                                        r"'fp16'\), got 'fp8'"):
        fxpar.Plan(precision="fp8")
    plan = fxpar.Plan(stages=2, precision="bf16")
    assert fxpar.Plan(**plan.to_json()) == plan


def _net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.ReflectionPad2d(1),
                         nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 5))


def _compiled(plan, dtype=torch.float32, model=None):
    model = (model or _net()).to(dtype)
    return fxpar.compile(model, plan, torch.empty(2, 3, 16, 16, dtype=dtype, device="meta"))


def _dtype(n):
    return meta.get(n, TensorInfo).dtypes[0]


def test_pass_writes_autocasts_casts():
    gm = _compiled(fxpar.Plan(precision="bf16")).traced
    nodes = list(gm.graph.nodes)
    convs = [n for n in nodes if n.target is aten.conv2d.default]
    assert len(convs) == 2
    for c in convs:  # input and weight (and bias) in bfloat16, as autocast casts them
        assert [_dtype(a) for a in c.all_input_nodes] == [torch.bfloat16] * 3, c.format_node()
        assert _dtype(c) == torch.bfloat16
    pad = next(n for n in nodes if n.target is aten.pad.default)  # reflect: float32 list
    assert _dtype(pad.args[0]) == torch.float32  # on autocast's CPU float32 list
    cast = pad.args[0]
    assert cast.target is aten._to_copy.default and cast.kwargs == {"dtype": torch.float32}
    bn = next(n for n in nodes if n.op == "call_module" and "bn" in str(n.target))
    # BatchNorm is on no list: bf16 input, float32 weight and statistics, as autocast runs it
    assert [_dtype(a) for a in bn.all_input_nodes][:3] == [torch.bfloat16, torch.float32,
                                                           torch.float32]
    linear = next(n for n in nodes if n.target is aten.linear.default)
    assert _dtype(linear) == torch.bfloat16
    attrs = [_dtype(n) for n in nodes if n.op == "get_attr"]  # float32 masters, int64 counts
    assert set(attrs) == {torch.float32, torch.int64}, attrs


def test_fp32_and_float64_models_get_no_casts():
    for plan, dtype in ((fxpar.Plan(), torch.float32),
                        (fxpar.Plan(precision="bf16"), torch.float64)):
        gm = _compiled(plan, dtype).traced  # autocast leaves float64 alone
        assert not [n for n in gm.graph.nodes if n.target is aten._to_copy.default], plan


def test_one_process_program_is_autocast_bit_for_bit():
    torch.manual_seed(0)
    model = _net()
    ref = __import__("copy").deepcopy(model)
    x, y = torch.randn(2, 3, 16, 16), torch.tensor([1, 3])
    rp = _compiled(fxpar.Plan(precision="bf16"), model=model).local()
    loss = rp.train_step(x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.cross_entropy(ref(x), y)
    want.backward()
    assert loss == want.item()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_pipeline_messages_travel_in_the_compute_dtype():
    program = _compiled(fxpar.Plan(stages=2, precision="bf16"))
    dtypes = {t.dtype for t in program.graph.transfers}
    assert dtypes == {torch.bfloat16}, dtypes
    fp32 = _compiled(fxpar.Plan(stages=2))
    assert {t.dtype for t in fp32.graph.transfers} == {torch.float32}


class _One:
    """A tile group of one rank (allgather returns the tile's own moments)."""

    def allgather(self, t):
        return [t]


def test_norm_statistics_are_float32_for_bf16_tiles():
    x = (torch.randn(2, 4, 8, 8) * 3 + 100).to(torch.bfloat16)
    mean, var = global_moments(x, _One())
    assert mean.dtype == var.dtype == torch.float32
    want_var, want_mean = torch.var_mean(x.double(), dim=(0, 2, 3), unbiased=False)
    torch.testing.assert_close(mean.double(), want_mean, rtol=1e-6, atol=0)
    torch.testing.assert_close(var.double(), want_var, rtol=1e-5, atol=0)
    assert (mean.double() - mean.to(torch.bfloat16).double()).abs().max() > 0  # not bf16


def test_loss_scale_follows_grad_scaler():
    """The same sequence of finite / overflowing steps moves LossScale and torch's GradScaler
    the same way (halve on inf, double after growth_interval good steps)."""
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", growth_interval=2)
    ours = LossScale(growth_interval=2)
    for bad in (False, False, False, True, False, True, True, False, False):
        opt.zero_grad()
        scaler.scale(p.sum() * (float("inf") if bad else 1.0)).backward()
        grads = [p.grad.clone()]
        scaler.step(opt)
        scaler.update()
        finite = ours.unscale(grads, None, torch.device("cpu"))
        assert finite == (not bad)
        assert ours.scale == scaler.get_scale()
        if not bad:
            assert torch.equal(grads[0], torch.ones(3))  # unscaled
    assert ours.skipped == 3

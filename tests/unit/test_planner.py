"""The planner (fxpar.plan_auto, fxpar.planner.planspace): its fast estimate against the full
cost model on compiled programs, its stage cuts against every cut over the same positions, its
enumeration against a brute-force count, memory pruning, and the CLI views. No MPI: the MPI case
(fxpar-run --plan auto trains like one process) is in tests/mpi/cases/driver_cases.py."""

from __future__ import annotations

import contextlib
import io
import itertools

import pytest
import torch

import fxpar
from fxpar.cli.inspect import main as inspect_main
from fxpar.core.plan import Plan, PlanError
from fxpar.models.zoo import build_model
from fxpar.perf.costmodel import predict
from fxpar.perf.memory import estimate
from fxpar.perf.profile import Profile
from fxpar.planner.planner import candidates, describe, layouts, plan_auto
from fxpar.planner.planspace import TOLERANCE, analyse, cut_positions, evaluate, stage_cuts

SHAPE = (8, 3, 64, 64)


@pytest.fixture(scope="module")
def profile() -> Profile:
    """A CPU-like machine: 4 slots per node, so 4 ranks run at full speed."""
    import dataclasses

    p = Profile.load("h100-nvlink-ib")
    return dataclasses.replace(p, name="test", conv_flops=5e10, matmul_flops=6e10,
                               dwconv_flops=2e9, mem_bytes=1.5e10, norm_bytes=4e9, op_s=2e-6,
                               tile_op_s=3e-4, tile_op_bytes=5e9, pool_rate=3e8,
                               ranks_per_node=4, slots_per_node=2)


@pytest.fixture(scope="module")
def table(profile):
    return analyse(build_model("torchvision:resnet18", meta=True, num_classes=10), SHAPE,
                   profile)


PLANS = [{}, {"stages": 2}, {"stages": 2, "microbatches": 4},
         {"stages": 3, "microbatches": 4, "schedule": "1f1b"}, {"spatial_parts": 2},
         {"spatial_parts": 4}, {"stages": 2, "gems": True, "microbatches": 2},
         {"data_parallel": 2}, {"stages": 2, "spatial_parts": 2, "microbatches": 2},
         {"spatial_parts": 2, "data_parallel": 2},
         {"stages": 3, "spatial_parts": 2, "spatial_stages": 2, "microbatches": 2,
          "schedule": "1f1b"}, {"stages": 3, "microbatches": 4, "schedule": "zero_bubble"},
         {"stages": 2, "gems": True, "microbatches": 2, "schedule": "zero_bubble"},
         {"stages": 2, "spatial_parts": 2, "microbatches": 4, "schedule": "zero_bubble"}]


@pytest.mark.parametrize("fields", PLANS, ids=[describe(Plan(**f)) for f in PLANS])
def test_fast_estimate_is_the_cost_model_of_the_compiled_program(table, profile, fields):
    plan = Plan(**fields)
    est = evaluate(table, plan)
    assert est is not None
    b = est.stages.bounds
    if plan.stages > 1:  # compile with the planner's own cuts
        plan = Plan(**fields, balance=tuple(y - x for x, y in zip(b, b[1:], strict=False)))
    program = fxpar.compile(build_model("torchvision:resnet18", meta=True, num_classes=10),
                            plan, torch.empty(SHAPE, device="meta"))
    full = predict(program, profile)
    assert est.step_s == pytest.approx(full.makespan, rel=0.03), (est.step_s, full.makespan)
    assert est.bubble == pytest.approx(full.bubble, abs=0.03)
    peak = max(m.total for m in estimate(program))
    assert 0.8 <= est.memory / peak <= 1.25, (est.memory, peak)


@pytest.mark.parametrize("stages, m", [(2, 4), (3, 4), (4, 8)])
def test_zero_bubble_estimate_splits_the_backward(table, stages, m):
    """Against 1F1B on the same cuts: the same work, a smaller ramp (ZB-H1's (p-1)(F+B-W)
    against (p-1)(F+B)), in closed form and in the simulator, which runs B and W at half the
    backward each; activations of min(m, S) micro-batches on every stage. Where the last
    stage is the slowest, both take about its start plus its m (F + B): little to fill."""
    one = evaluate(table, Plan(stages=stages, microbatches=m, schedule="1f1b"))
    zb = evaluate(table, Plan(stages=stages, microbatches=m, schedule="zero_bubble"))
    assert one is not None and zb is not None and zb.stages == one.stages
    st = zb.stages
    work = [f + b for f, b in zip(st.f, st.b, strict=True)]
    assert zb.step_s <= one.step_s and zb.bubble <= one.bubble
    if max(range(stages), key=lambda j: work[j]) != stages - 1:
        assert zb.step_s < 0.99 * one.step_s
    fast = evaluate(table, Plan(stages=stages, microbatches=m, schedule="zero_bubble"),
                    exact=False)
    assert fast is not None and fast.step_s == pytest.approx(zb.step_s, rel=0.1)
    assert fast.step_s >= m * max(work) + sum(st.f) - max(st.f)  # communication on top
    assert zb.memory >= one.memory


def test_candidates_try_every_pipeline_schedule():
    plans, _ = candidates(2, 8, 0, 2)
    pipelined = {(p.microbatches, p.schedule) for p in plans if p.stages == 2 and not p.gems}
    assert pipelined == {(1, "gpipe")} | {(m, s) for m in (2, 4, 8)
                                         for s in ("gpipe", "1f1b", "zero_bubble")}


def test_the_harness_sees_a_wrong_estimate(profile):
    """The comparison above fails for an estimate made with convolutions 8 % slower."""
    import dataclasses

    slow = analyse(build_model("torchvision:resnet18", meta=True, num_classes=10), SHAPE,
                   dataclasses.replace(profile, conv_flops=profile.conv_flops / 1.08))
    plan = Plan(stages=2, microbatches=4)
    worse = evaluate(slow, plan)
    assert worse is not None
    program = fxpar.compile(build_model("torchvision:resnet18", meta=True, num_classes=10),
                            plan, torch.empty(SHAPE, device="meta"))
    full = predict(program, profile)
    assert worse.step_s != pytest.approx(full.makespan, rel=0.03), (worse.step_s,
                                                                    full.makespan)


def test_cut_positions_are_the_local_minima_of_the_traffic():
    assert cut_positions([0, 5, 3, 3, 7, 2, 2, 4, 0]) == [0, 2, 5, 8]
    assert cut_positions([0, 1, 2, 3]) == [0, 3]


@pytest.mark.parametrize("k", [2, 3, 4])
def test_stage_cuts_are_the_best_over_all_cuts_of_the_positions(table, k):
    """networkx's cut: its slowest stage is the smallest any cut over the same positions
    gets (within the tolerance), and no cut that close has fewer bytes crossing."""
    def stages(bounds):
        plan = Plan(stages=k, balance=tuple(y - x for x, y in zip(bounds, bounds[1:],
                                                                  strict=False)))
        e = evaluate(table, plan, exact=False)
        assert e is not None
        return max(f + b for f, b in zip(e.stages.f, e.stages.b, strict=True))

    pos = table.positions
    every = [(0, *c, pos[-1]) for c in itertools.combinations(pos[1:-1], k - 1)]
    worst = {c: stages(c) for c in every}
    best = min(worst.values())
    chosen = stage_cuts(table, k, 0, None)
    assert chosen is not None and chosen in worst
    assert worst[chosen] <= best * (1 + TOLERANCE) * 1.001
    near = [c for c in every if worst[c] <= best * (1 + TOLERANCE)]
    traffic = {c: sum(table.traffic[p] for p in c[1:-1]) for c in near}
    assert traffic[chosen] == min(traffic.values())


def test_layouts_are_every_way_to_use_the_ranks():
    got = {(d["data_parallel"], d["stages"], d.get("spatial_stages", 0),
            d.get("spatial_parts", 1)) for d in layouts(12, 12, 2, 8)}
    want = set()
    for dp, k in itertools.product(range(1, 13), range(1, 9)):
        for s in range(0, k + 1):
            for p in range(2 if s else 1, 13):
                grid = Plan(spatial_parts=p).tile_grid(2) if s else (1, 1)
                even = p <= 3 or max(grid) <= 2 * min(grid)
                if dp * (s * p + k - s) == 12 and (s == 0) == (p == 1) and even:
                    want.add((dp, k, s, p))
    assert got == want
    assert (1, 1, 1, 12) in got and (2, 2, 1, 5) not in got  # 5 tiles: a 1x5 strip


def test_plan_auto_ranks_plans_that_fit_and_counts_the_rest(profile):
    model = build_model("torchvision:resnet18", meta=True, num_classes=10)
    free = plan_auto(model, SHAPE, 4, None, profile, check=False)
    budget = sorted(e.memory for e in free.ranked)[len(free.ranked) // 2]
    found = plan_auto(model, SHAPE, 4, budget, profile)
    assert all(e.memory <= budget for e in found.ranked)
    assert all(e.plan.world_size == 4 for e in found.ranked)
    steps = [e.step_s for e in found.ranked[:48]]
    assert steps == sorted(steps)
    assert {r.kind for r in found.rejected} >= {"memory", "batch"}
    best = found.ranked[0].plan
    assert (found.plan.stages, found.plan.spatial_parts, found.plan.data_parallel) == (
        best.stages, best.spatial_parts, best.data_parallel)
    assert found.plan.world_size == 4
    text = found.report()
    assert text.startswith("plan search: 4 rank(s)") and f"chosen: {describe(found.plan)}" \
        in text


def test_plan_auto_says_what_the_closest_plan_needs(profile):
    model = build_model("torchvision:resnet18", meta=True, num_classes=10)
    with pytest.raises(PlanError, match=r"no plan of 4 rank\(s\) fits \(closest: .* needs"):
        plan_auto(model, SHAPE, 4, 2**10, profile)


def test_at_16384_only_spatial_plans_fit_80_gib():
    """ResNet-50 at 16384^2, 8 images on 64 H100s: even a stage of 8 holds more of an image's
    activations than one GPU, so the plans that fit all cut images into tiles."""
    model = build_model("torchvision:resnet50", meta=True, num_classes=10)
    found = plan_auto(model, (8, 3, 16384, 16384), 64, 80 * 2**30, check=False)
    assert found.ranked and all(e.plan.spatial for e in found.ranked)
    assert any(r.kind == "memory" and not r.plan.spatial for r in found.rejected)
    assert found.plan.spatial_parts >= 2


def _inspect(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = inspect_main(argv)
    return code, out.getvalue(), err.getvalue()


def test_inspect_auto_prints_the_search():
    code, out, _ = _inspect(["torchvision:resnet18", "--image-size", "64", "--batch-size", "8",
                             "--auto", "--world-size", "4", "--memory-per-rank", "1GiB"])
    assert code == 0
    assert "plan search: 4 rank(s), memory per rank 1.00 GiB, profile 'h100-nvlink-ib'" in out
    assert "chosen: " in out and "fxpar-run flags: " in out


@pytest.mark.parametrize("argv,message", [
    (["--auto"], "--auto plans for a number of ranks: add --world-size N"),
    (["--world-size", "4"], "--world-size is the ranks --auto plans for: add --auto"),
    (["--auto", "--world-size", "4", "--stages", "2"], "the planner chooses --stages: drop it"),
])
def test_inspect_auto_usage_errors(argv, message):
    code, _, err = _inspect(["torchvision:resnet18", "--image-size", "64", *argv])
    assert code == 2 and message in err, err


def test_plan_auto_searches_and_checks_a_library_model_built_on_meta():
    """timm's ConvNeXt: LayerNorm on channels-last islands (tiled nodes whose inputs are not
    N, C, H, W) and a layer-scale gamma with no reset_parameters, built on meta: the search
    costs it and the check compiles its choice without initialising anything."""
    model = build_model("timm:convnext_atto", meta=True, num_classes=10)
    found = plan_auto(model, (8, 3, 256, 256), 4, None)
    assert found.plan.world_size == 4 and found.seconds[2] > 0
    assert any(e.plan.spatial for e in found.ranked)


def test_compile_takes_what_plan_auto_returns():
    """fxpar.compile(model, fxpar.plan_auto(...), x): the chosen plan, with its cuts; anything
    that is neither a Plan nor a plan search's result is refused with what to pass."""
    model = build_model("torchvision:resnet18", meta=True, num_classes=5)
    found = fxpar.plan_auto(model, (8, 3, 64, 64), 4, check=False)
    program = fxpar.compile(model, found, (8, 3, 64, 64))
    assert program.plan == found.plan and program.world_size == 4
    with pytest.raises(TypeError, match=r"fxpar.Plan\(...\) or what fxpar.plan_auto returns, "
                                        r"got dict"):
        fxpar.compile(model, {"stages": 2}, (8, 3, 64, 64))


class _TokenAttention(torch.nn.Module):
    """A patch embedding, global attention over every token (ring attention on tiles), back
    to the image, a 1x1 head."""

    def __init__(self, c: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Conv2d(3, c, 4, stride=4)
        self.qkv = torch.nn.Linear(c, 3 * c)
        self.head = torch.nn.Conv2d(c, 10, 1)

    def forward(self, x):
        x = self.embed(x)
        n, c, h, w = x.shape
        q, k, v = self.qkv(x.flatten(2).transpose(1, 2)).chunk(3, -1)
        t = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.head(t.transpose(1, 2).reshape(n, c, h, w)).mean((2, 3))


def test_fast_estimate_counts_ring_attention_messages(profile):
    """On a slow link the ring's K and V blocks are most of an SP2 step: the fast estimate
    must charge them as the full cost model of the compiled program does."""
    import dataclasses

    slow = dataclasses.replace(profile, p2p_intra=dataclasses.replace(
        profile.p2p_intra, beta=profile.p2p_intra.beta * 1e4))
    shape, plan = (4, 3, 128, 128), Plan(spatial_parts=2)
    program = fxpar.compile(_TokenAttention(), plan, torch.empty(shape, device="meta"))
    steps = {}
    for name, prof in (("fast", profile), ("slow", slow)):
        est = evaluate(analyse(_TokenAttention(), shape, prof), plan)
        assert est is not None
        full = predict(program, prof).makespan
        assert est.step_s == pytest.approx(full, rel=0.05), (name, est.step_s, full)
        steps[name] = est.step_s
    assert steps["slow"] > 2 * steps["fast"], steps

"""The cost model (issue 20): machine profiles, the calibration's fits (against a fake
communicator with known costs), the timed simulator against hand-computed schedules, and the
seconds it gives a compiled program's halo exchanges. No MPI."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import fxpar
from fxpar.compiler.driver import links_of
from fxpar.core.schedule import pipeline
from fxpar.passes.spatial_region import image_grid
from fxpar.perf.costmodel import halo_seconds, node_times, stage_seconds, timing
from fxpar.perf.profile import Link, Profile, ProfileError
from fxpar.perf.simulate import Timing, simulate
from fxpar.planner import calibrate
from fxpar.planner.calibrate import communication, compute, fit, fixed_rows


def _profile(**kw) -> Profile:
    base = dict(name="test", device="cpu", conv_flops=1e10, matmul_flops=1e10, mem_bytes=1e9,
                op_s=0.0, p2p_intra=Link(1e-3, 1e-9), p2p_inter=Link(1e-2, 1e-8),
                allreduce_intra=Link(1e-4, 1e-9), allreduce_inter=Link(1e-3, 1e-8),
                ranks_per_node=2)
    return Profile(**{**base, **kw})


def test_profile_round_trips_and_the_shipped_one_loads(tmp_path):
    p = _profile()
    p.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == p
    h100 = Profile.load("h100-nvlink-ib")
    assert h100.ranks_per_node == 8 and h100.sources and h100.notes
    assert h100.link(0, 7) == h100.p2p_intra and h100.link(7, 8) == h100.p2p_inter
    assert p.link(0, 3, collective=True) == p.allreduce_inter


def test_bad_profiles_say_what_to_change(tmp_path):
    data = _profile().to_json()
    del data["mem_bytes"]
    (tmp_path / "a.json").write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"a.json: missing mem_bytes"):
        Profile.load(tmp_path / "a.json")
    data = {**_profile().to_json(), "p2p_intra": [1e-6]}
    (tmp_path / "b.json").write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"p2p_intra must be \[alpha seconds, beta seconds "):
        Profile.load(tmp_path / "b.json")
    with pytest.raises(ProfileError, match=r"shipped: h100-nvlink-ib"):
        Profile.load("no-such-machine")


def test_fit_recovers_alpha_and_beta():
    link = fit([(b, 2e-5 + 3e-10 * b) for b in (8, 1024, 65536, 1 << 20, 4 << 20)])
    assert link.alpha == pytest.approx(2e-5, rel=1e-3)
    assert link.beta == pytest.approx(3e-10, rel=1e-6)


class _SlowComm:
    """Rank 0 of 2 on a clock of its own: send / recv cost ``alpha + beta * bytes``, an
    allreduce 2 (g - 1) ring steps of ``alpha_ar + beta_ar * bytes / g`` (the calibration reads
    this clock, so a loaded machine's jitter cannot move the fit: it once did, by 31 %)."""

    rank, size = 0, 2

    def __init__(self, p2p: Link, ar: Link) -> None:
        self.p2p, self.ar = p2p, ar
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def barrier(self) -> None:
        pass

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.now += self.p2p.seconds(t.numel() * 4)

    recv = send

    def allreduce(self, t: torch.Tensor) -> torch.Tensor:
        self.now += 2 * (self.size - 1) * self.ar.seconds(t.numel() * 4 / self.size)
        return t


def test_calibration_fits_known_link_costs(monkeypatch):
    p2p, ar = Link(2e-5, 1e-9), Link(3e-5, 2e-9)
    comm = _SlowComm(p2p, ar)
    monkeypatch.setattr(calibrate, "time", comm)  # the timings read the fake comm's clock
    got = communication(comm, repeats=2)  # type: ignore[arg-type]
    # alpha: the smallest message's time (8 bytes; 4 per allreduce ring step); beta: the
    # slope above it through the other sizes (the 8 bytes move it by 2e-6 relative)
    assert got["p2p"].alpha == pytest.approx(p2p.alpha + p2p.beta * 8, rel=1e-9)
    assert got["p2p"].beta == pytest.approx(p2p.beta, rel=1e-5)
    assert got["allreduce"].alpha == pytest.approx(ar.alpha + ar.beta * 4, rel=1e-9)
    assert got["allreduce"].beta == pytest.approx(ar.beta, rel=1e-5)


def test_compute_calibration_gives_positive_rates():
    rates = compute(min_run_time=0.01, quick=True)
    # wide bounds: a 10 ms timing on a loaded machine can lose most of its core (a run beside
    # the MPI streams measured 2.4e7 matmul FLOP/s); a rate in the wrong unit is still caught
    assert 1e6 < rates["conv_flops"] < 1e16 and 1e6 < rates["matmul_flops"] < 1e16
    assert 1e6 < rates["mem_bytes"] < 1e14 and rates["op_s"] > 0
    assert len(rates["convs"]) == 3
    assert rates["conv_pixels"] >= 0 and len(rates["calls"]) == len(calibrate.CALL_CHANNELS)


def test_fixed_rows_inverts_the_call_model():
    """t = k (rows + p0): the ratio of two calls' times gives p0 back; a small call as slow as
    a large one (or slower: noise) fits nothing."""
    for p0 in (0.0, 25.0, 300.0):
        q = (64 + p0) / (1024 + p0)
        assert fixed_rows(64, 1024, q) == pytest.approx(p0)
    assert fixed_rows(64, 1024, 1.0) == 0.0 and fixed_rows(64, 1024, 1.5) == 0.0


def test_a_convolution_call_pays_its_fixed_rows_once():
    """conv_pixels = p0: a call of R output rows costs FLOPs x (R + p0) / R / rate, so the
    fixed part (share 0) is FLOPs / R x p0 / rate whatever the share, and a tile (share 1/2)
    pays it in full; without conv_pixels a call is linear in its rows."""
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 64, 2))
    program = fxpar.compile(model, fxpar.Plan(), torch.empty(2, 8, 8, 8, device="meta"))
    conv = next(n for n in program.traced.graph.nodes if "conv2d" in str(n.target))
    flops, rows = 2 * 2 * 64 * 8 * 8 * 9, 2 * 64  # multiply-add = 2; 2 images of 8x8
    prof = _profile(conv_pixels=50.0)
    fixed, _ = node_times(conv, prof, 0.0)
    whole, back = node_times(conv, prof, 1.0)
    half, _ = node_times(conv, prof, 0.5)
    assert fixed == pytest.approx(flops / rows * 50 / 1e10)
    assert whole == pytest.approx(flops * (rows + 50) / rows / 1e10) and back == 2 * whole
    assert half == pytest.approx(fixed + flops / 2 / 1e10)
    assert node_times(conv, _profile(), 0.0)[0] == 0.0
    linear = next(n for n in program.traced.graph.nodes if "linear" in str(n.target))
    assert node_times(linear, prof, 0.0)[0] == 0.0  # matrix products: not fitted, not charged


def test_micro_batches_of_one_image_cost_more_per_image_with_a_call_cost():
    """The planner's table: ResNet-18 at 64x64, per image, F + B of micro-batches of 1 costs
    more than one batch of 8 when calls have a fixed cost, and the same without one."""
    from fxpar.models.zoo import build_model
    from fxpar.planner.planspace import analyse

    model = build_model("torchvision:resnet18", meta=True, num_classes=10)
    per_image = {}
    for p0 in (0.0, 50.0):
        t = analyse(model, (8, 3, 64, 64), _profile(conv_pixels=p0))
        sums = t.prefix(None)
        per_image[p0] = [sum(sums.compute(0, t.size, mb, False, back) for back in (False, True))
                         / mb for mb in (1, 8)]
    assert per_image[0.0][0] == pytest.approx(per_image[0.0][1], rel=1e-3)
    assert per_image[50.0][0] > 1.3 * per_image[50.0][1]


def _uniform(f: float, latency: float, step: float) -> Timing:
    def seconds(rank: int, a) -> float:
        return {"F": f, "B": 2 * f, "STEP": step}.get(a.kind, 0.0)

    return Timing(seconds, lambda send, src, dst: latency, {}, {})


@pytest.mark.parametrize("p,m", [(2, 1), (3, 4), (4, 8)])
def test_timed_gpipe_matches_the_hand_formula(p, m):
    """Uniform stages (F = f, B = 2f), messages taking L, a STEP of s: the first micro-batch
    crosses p stages and p - 1 links forward, the last stage runs m F and m B, the gradient
    crosses back: (m + p - 1)(f + 2f) + 2 (p - 1) L + s."""
    f, latency, step = 0.5, 0.125, 0.25
    sched = pipeline(p, m, "gpipe")
    links = {s: {s + 1} for s in range(p - 1)} | {p - 1: set()}
    sim = simulate(sched, links, timing=_uniform(f, latency, step))
    assert sim.makespan == pytest.approx((m + p - 1) * 3 * f + 2 * (p - 1) * latency + step)


def test_timed_1f1b_without_latency_matches_gpipe():
    sched = pipeline(4, 8, "1f1b")
    links = {s: {s + 1} for s in range(3)} | {3: set()}
    sim = simulate(sched, links, timing=_uniform(1.0, 0.0, 0.0))
    assert sim.makespan == pytest.approx((8 + 4 - 1) * 3.0)
    assert sim.bubble == pytest.approx(3 / 11)


def test_halo_seconds_of_one_convolution_on_two_tiles():
    """A 3x3 convolution on 2 vertical tiles of a 1x4x16x16 input: each tile sends one column
    and receives one (16 cells x 4 channels x 4 bytes): 2 messages, in parallel."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    prof = _profile()
    program = fxpar.compile(model, fxpar.Plan(spatial_parts=2, slice="vertical"),
                            torch.empty(1, 3, 16, 16, device="meta"))
    gm = program.traced
    convs = [n for n in gm.graph.nodes if "conv" in str(n.target)]
    grid = image_grid(gm)
    assert halo_seconds(gm, convs[0], grid, 0, prof) == 0.0  # reads the input image
    want = 2 * prof.p2p_intra.alpha + 16 * 4 * 4 * prof.p2p_intra.beta
    assert halo_seconds(gm, convs[1], grid, 0, prof) == pytest.approx(want)
    sp = stage_seconds(program, prof)[0]
    assert sp.comm_f == pytest.approx(want) and sp.comm_b == pytest.approx(want)
    # the runtime's cost of that tile op: fixed, plus the tile's bytes (4 x 16 x 8 cells x 4 B)
    ops = _profile(tile_op_s=1e-4, tile_op_bytes=1e8)
    tile = 4 * 16 * 8 * 4
    sp = stage_seconds(program, ops)[0]
    assert sp.comm_f == pytest.approx(want + 1e-4 + tile / 1e8)


def test_timing_of_a_pipeline_program_adds_link_costs():
    """2 stages: a faster link shortens the simulated step by the messages' share."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    program = fxpar.compile(model, fxpar.Plan(stages=2, microbatches=2),
                            torch.empty(4, 3, 32, 32, device="meta"))
    slow = simulate(program.schedule, links_of(program.graph),
                    timing=timing(program, _profile()))
    fast = simulate(program.schedule, links_of(program.graph),
                    timing=timing(program, _profile(p2p_intra=Link(0.0, 0.0))))
    assert slow.makespan > fast.makespan
    # each micro-batch's activation crosses once forward and its gradient once back, 2 of
    # each on the critical path at least (first forward, last backward)
    assert slow.makespan - fast.makespan >= 2 * 1e-3


def test_pools_cost_their_windows_where_the_profile_measured_them():
    """A 3x3 max pool (stride 1) on 2x4x8x8: 512 outputs x 9 window elements at pool_rate;
    its backward scatters the gradient (memory-bound); a 2x2 average pool's backward costs
    its forward. Without pool_rate both stay memory-bound with the usual 2x backward."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.MaxPool2d(3, 1, 1),
                          nn.AvgPool2d(2), nn.Flatten(), nn.Linear(64, 2))
    program = fxpar.compile(model, fxpar.Plan(), torch.empty(2, 3, 8, 8, device="meta"))
    nodes = {str(n.target).split(".")[1]: n for n in program.traced.graph.nodes
             if "pool" in str(n.target)}
    mx, avg = nodes["max_pool2d"], nodes["avg_pool2d"]
    prof = _profile(pool_rate=1e6, op_s=1e-6)
    f, b = node_times(mx, prof, 1.0)
    assert f == pytest.approx(1e-6 + 512 * 9 / 1e6)
    out_bytes = 512 * 4
    assert b == pytest.approx(1e-6 + 2 * out_bytes / prof.mem_bytes)
    f, b = node_times(avg, prof, 0.5)  # half of it: one tile of two
    assert f == pytest.approx(1e-6 + 0.5 * 128 * 4 / 1e6) and b == f
    plain = _profile(op_s=1e-6)
    f, b = node_times(mx, plain, 1.0)
    assert f == pytest.approx(1e-6 + 2 * out_bytes / plain.mem_bytes) and b == 2 * f


def test_conv_rate_takes_the_nearest_measured_shape():
    p = _profile(conv_grid=((16, 1, 1e9), (16, 3, 2e9), (256, 1, 3e9), (256, 3, 4e9)))
    assert p.conv_rate(24, 3) == 2e9 and p.conv_rate(100, 3) == 4e9  # log scale: 64 is nearer
    assert p.conv_rate(512, 1) == 3e9 and p.conv_rate(3, 7) == 2e9
    assert _profile().conv_rate(64, 3) == 1e10  # no grid: the one rate
    assert Profile.from_json(p.to_json()) == p

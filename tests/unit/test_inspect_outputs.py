"""fxpar-inspect's dumps and pictures: --after PASS, --rank, --dot/--svg, --timeline, --memory.

In-process (``fxpar.cli.inspect.main`` with capsys), no MPI. Each output is checked against
what the compiler itself holds (node tables, generated sources, transfers, simulated spans) or
against numbers computed here by hand from the model's layers and shapes.
"""

import json
import re
import shutil

import matplotlib.colors
import matplotlib.image
import pytest
import torch
from torch import nn

import fxpar
from fxpar.cli.inspect import PASS_NAMES, main
from fxpar.compiler.report import node_table
from fxpar.core.schedule import Action, pipeline
from fxpar.core.units import nbytes
from fxpar.passes.split_stages import StageAssignment
from fxpar.perf import memory
from fxpar.perf.simulate import simulate, stage_costs
from fxpar.program.emit import rank_sources
from fxpar.report import draw

# A tiny CNN whose sizes are easy to compute by hand: 3x8x8 images, batch 4, 2 micro-batches.
NET = '''
import torch.nn as nn

def make(dtype="float32"):
    import torch
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 1),
                         nn.Flatten(), nn.Linear(2 * 8 * 8, 5)).to(getattr(torch, dtype))
'''
SPATIAL_NET = '''
import torch.nn as nn

def make():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(4, 4, 3, padding=1), nn.Flatten(),
                         nn.Linear(4 * 8 * 8, 5))
'''


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    d = tmp_path_factory.mktemp("nets")
    (d / "net.py").write_text(NET)
    (d / "spatial_net.py").write_text(SPATIAL_NET)
    return {"net": f"{d / 'net.py'}:make", "spatial": f"{d / 'spatial_net.py'}:make"}


def cli(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def small(net, *extra):
    return [net["net"], "--image-size", 8, "--batch-size", 4, *extra]


def spatial(net, *extra):
    return [net["spatial"], "--image-size", 16, "--batch-size", 2, "--stages", 2,
            "--spatial-parts", 2, "--balance", "6,1", *extra]


def build(net, stages=2, schedule="gpipe", dtype=torch.float32, **plan):
    from fxpar.models.zoo import build_model

    model = build_model(net["net"]).to(dtype)
    plan = fxpar.Plan(stages=stages, microbatches=2, schedule=schedule,
                      balance=(2, 3) if stages == 2 else None, **plan)
    return model, fxpar.compile(model, plan, torch.empty(4, 3, 8, 8, dtype=dtype,
                                                         device="meta"))


@pytest.fixture(scope="module")
def program(net):
    return build(net)[1]


def spatial_program(net):
    from fxpar.models.zoo import build_model

    model = build_model(net["spatial"])
    plan = fxpar.Plan(stages=2, spatial_parts=2, balance=(6, 1))
    return fxpar.compile(model, plan, torch.empty(2, 3, 16, 16, device="meta"))


# -- --after PASS ------------------------------------------------------------------------------
def test_compile_calls_after_pass_with_every_pass_in_order(net):
    seen = []
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    fxpar.compile(model, fxpar.Plan(stages=2), (2, 3, 8, 8),
                  after_pass=lambda name, gm: seen.append(
                      (name, all("fxpar.stage" in n.meta for n in gm.graph.nodes
                                 if n.op == "call_function"))))
    assert [name for name, _ in seen] == ["trace", "precision", "spatial_region",
                                          "split_stages", "limit_region"]
    assert [has for _, has in seen] == [False, False, False, True, True]  # dumped at that moment


def test_after_unknown_pass_lists_the_valid_names(capsys, net):
    rc, out, err = cli(capsys, *small(net, "--after", "halos"))
    assert rc == 2 and out == ""
    assert ("unknown pass 'halos' for --after; valid names: trace, precision, "
            "spatial_region, split_stages, limit_region, halo") in err
    assert PASS_NAMES == ("trace", "precision", "spatial_region", "split_stages", "limit_region",
                          "halo")


def test_after_trace_is_the_node_table_of_the_traced_micro_batch(capsys, net):
    rc, out, _ = cli(capsys, *small(net, "--stages", 2, "--microbatches", 2, "--after",
                                    "trace"))
    assert rc == 0
    from fxpar.models.zoo import build_model

    traced = fxpar.trace(build_model(net["net"]), (2, 3, 8, 8))  # per micro-batch of 2
    dump = out.split("after pass 'trace':\n")[1]
    assert dump.rstrip("\n") == node_table(traced)


def test_after_split_stages_adds_the_stage_of_every_node(capsys, net, program):
    rc, out, _ = cli(capsys, *small(net, "--stages", 2, "--microbatches", 2, "--balance", "2,3",
                                    "--after", "split_stages", "--code"))
    assert rc == 0
    lines = out.split("after pass 'split_stages':\n")[1].splitlines()
    assert lines[0].split()[-1] == "stage"
    got = {line.split()[1]: line.split()[-1] for line in lines[1:]
           if re.match(r"\s*\d+\s", line)}
    want = {n.name: str(n.meta[StageAssignment.KEY].stage) for n in program.traced.graph.nodes
            if StageAssignment.KEY in n.meta and n.op != "get_attr"}  # (not in the table)
    assert {k: got[k] for k in want} == want
    assert [got[k] for k in ("conv2d", "relu", "conv2d_1", "flatten", "linear")] == \
        ["0", "0", "1", "1", "1"]
    assert "def forward(self, input):" in out  # --code: the graph's Python
    assert "model_output = fxpar_passes_split_stages_model_output(linear)" in out


def test_after_region_passes_show_the_spatial_layout(capsys, net):
    rc, out, _ = cli(capsys, *spatial(net, "--after", "spatial_region"))
    assert rc == 0
    rows = {line.split()[1]: line for line in out.splitlines()[3:]
            if re.match(r"\s*\d+\s", line)}
    assert rows["conv2d"].rstrip().endswith("tiled")
    assert rows["conv2d_1"].rstrip().endswith("tiled")
    assert re.search(r"replicated \(region ends at 'flatten': aten.flatten \(module '5' "
                     r"\(Flatten\), torch/nn/modules/flatten.py:\d+\) cannot run on tiles; "
                     r"the token block it starts stops at aten.linear \(module '6' \(Linear\).*: "
                     r"it acts "
                     r"along a dim that is split over the tiles\)",
                     rows["flatten"])
    rc, out, _ = cli(capsys, *spatial(net, "--after", "limit_region"))
    assert rc == 0 and "stage, layout" in out.splitlines()[2]
    rows = {line.split()[1]: line for line in out.splitlines()[3:]
            if re.match(r"\s*\d+\s", line)}
    assert rows["conv2d_1"].split()[-2:] == ["0", "tiled"]
    assert "0  replicated (region ends at 'flatten'" in rows["flatten"]
    assert rows["linear"].split()[-2:] == ["1", "replicated"]


def test_after_halo_prints_the_tile_module_of_the_rank(capsys, net):
    rc, out, _ = cli(capsys, *spatial(net, "--after", "halo"))
    assert rc == 0
    assert "after pass 'halo': stage 0, " in out and "Tile0 " in out
    assert "across tiles" in out
    assert re.search(r"HaloOp .* scatter: slice rows -1:17 cols -1:9 of the whole tensor", out)
    assert re.search(r"HaloOp .* halo t=0 b=0 l=0 r=0 \(no exchange\)", out)  # 2x2 pool
    assert re.search(r"HaloOp .* halo t=1 b=1 l=1 r=1 <- tiles \[1\] -> tiles \[1\]", out)
    assert re.search(r"TileBatchNorm .* BatchNorm statistics: allgather over tiles", out)
    assert re.search(r"Join .* join: gather 2 tiles", out)
    rc, out, _ = cli(capsys, *spatial(net, "--after", "halo", "--rank", 1, "--code"))
    assert rc == 0 and "Tile1 " in out and "halo t=1 b=1 l=1 r=1 <- tiles [0]" in out
    assert "self.fxpar_syncbn_1(" in out  # the code calls it


def test_after_halo_without_spatial_stages_is_a_clear_error(capsys, net):
    rc, _, err = cli(capsys, *small(net, "--stages", 2, "--after", "halo"))
    assert rc == 2 and "this plan has none: add --spatial-parts P (P > 1)" in err


# -- --rank ------------------------------------------------------------------------------------
def test_rank_prints_the_generated_files(capsys, net, program):
    rc, out, _ = cli(capsys, *small(net, "--stages", 2, "--microbatches", 2, "--balance", "2,3",
                                    "--rank", 1))
    assert rc == 0
    files = rank_sources(program, 1)
    assert set(files) == {"c0_s1/module.py", "actions.txt"}
    for name, text in files.items():
        assert f"# ---- rank 1: {name} ----\n{text.rstrip()}" in out
    rc, _, err = cli(capsys, *small(net, "--stages", 2, "--rank", 2))
    assert rc == 2 and "--rank 2 is outside this plan's 2 rank(s): use 0..1" in err


# -- --dot / --svg -----------------------------------------------------------------------------
def test_dot_has_a_cluster_per_stage_coloured_nodes_and_marked_transfers(capsys, net,
                                                                         tmp_path):
    f = tmp_path / "g.dot"
    rc, out, _ = cli(capsys, *spatial(net, "--dot", f))
    assert rc == 0 and f"wrote {f} (DOT" in out
    text = f.read_text()
    nodes, edges = _parse_dot(text)
    # every edge joins declared nodes (DOT would silently invent a missing one)
    declared = {n for cluster in nodes.values() for n in cluster}
    assert all(a in declared and b in declared for cluster in edges.values()
               for a, b in cluster), edges
    # the tile module and the last stage, by hand: their ops in data-flow order (parameters and
    # buffers aside) and how many get_attr inputs each op reads
    assert _chain(nodes["cluster_stage0"], edges["cluster_stage0"]) == [
        ("placeholder", 0), ("HaloOp", 2), ("TileBatchNorm", 5), ("relu", 0),
        ("HaloOp", 0), ("HaloOp", 2), ("Join", 0), ("flatten", 0), ("output", 0)]
    assert _chain(nodes["cluster_stage1"], edges["cluster_stage1"]) == [
        ("placeholder", 0), ("linear", 2), ("model_output", 0), ("output", 0)]
    ops0 = list(nodes["cluster_stage0"].values())
    assert ops0.count("get_attr") == 9  # 2 convolutions' weight and bias, BN's 5 tensors
    # the one transfer: stage 0's flatten to stage 1's input, outside both clusters
    (tail, head), = edges[""]
    assert nodes["cluster_stage0"][tail] == "flatten" and \
        nodes["cluster_stage1"][head] == "placeholder"
    for s in (0, 1):
        assert f"subgraph cluster_stage{s} {{" in text
        assert f'fillcolor="{draw.STAGE_COLOURS[s]}"' in text
    assert "subgraph cluster_legend {" in text
    assert "tile module of a 1x2 grid" in text and "ranks 0, 1" in text
    # halo, BN sync and join nodes carry their own shapes
    assert re.search(r"s0_fxpar_halo_\d+ \[label=\"fxpar_halo_\d+\\nHaloOp.*shape=octagon", text)
    assert re.search(r"label=\"fxpar_syncbn_\d+\\nTileBatchNorm.*shape=hexagon", text)
    assert re.search(r"label=\"fxpar_join_\d+.*shape=invtrapezium", text)
    # one bold red edge per transfer, labelled with shape and bytes
    prog = spatial_program(net)
    edges = re.findall(r"(s\d+_\w+) -> (s\d+_\w+) \[label=\"send (\d)->(\d)\\n([^\"]*)\"", text)
    assert len(edges) == len(prog.graph.transfers) >= 1
    for (_tail, head, a, b, label), t in zip(edges, prog.graph.transfers, strict=True):
        assert (int(a), int(b)) == (t.src, t.dst) and head.startswith(f"s{t.dst}_")
        assert "x".join(map(str, t.shape)) in label and nbytes(t.nbytes) in label
    assert text.count(f'fontcolor="{draw.TRANSFER["color"]}"') == len(prog.graph.transfers) + 1


def _parse_dot(text: str) -> tuple[dict[str, dict[str, str]], dict[str, list[tuple[str, str]]]]:
    """The DOT that graphviz.Digraph writes, read back without the ``dot`` program: per
    subgraph (top level: ""), node id -> op (the second line of its label), and its edges."""
    nodes: dict[str, dict[str, str]] = {"": {}}
    edges: dict[str, list[tuple[str, str]]] = {"": []}
    stack = [""]
    for line in text.splitlines()[1:]:
        line = line.strip()
        if m := re.fullmatch(r"subgraph (\w+) \{", line):
            stack.append(m[1])
            nodes[m[1]], edges[m[1]] = {}, []
        elif line == "}":
            stack.pop()
        elif m := re.match(r"(\w+) -> (\w+)(?: \[|$)", line):
            edges[stack[-1]].append((m[1], m[2]))
        elif m := re.match(r'(\w+) \[label="([^"]*)"', line):
            nodes[stack[-1]][m[1]] = m[2].split("\\n")[1] if "\\n" in m[2] else m[2]
    assert stack == [], f"unbalanced braces: {stack}"
    return nodes, edges


def _chain(nodes: dict[str, str], edges: list[tuple[str, str]]) -> list[tuple[str, int]]:
    """The ops of a stage that is one path from its input to its output (get_attr nodes
    aside), in order, each with the number of get_attr nodes feeding it."""
    attrs = {n for n, op in nodes.items() if op == "get_attr"}
    succ: dict[str, list[str]] = {}
    fed = dict.fromkeys(nodes, 0)
    for a, b in edges:
        if a in attrs:
            fed[b] += 1
        else:
            succ.setdefault(a, []).append(b)
    start = [n for n, op in nodes.items() if op == "placeholder"]
    assert len(start) == 1, start
    path = start
    while path[-1] in succ:
        nxt = succ[path[-1]]
        assert len(nxt) == 1, f"{path[-1]} feeds {nxt}: not a chain"
        path.append(nxt[0])
    assert set(path) | attrs == set(nodes), set(nodes) - set(path) - attrs
    return [(nodes[n], fed[n]) for n in path]


def test_svg_without_dot_says_how_to_get_it(capsys, net, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot` on this PATH
    rc, _, err = cli(capsys, *small(net, "--svg", tmp_path / "g.svg"))
    assert rc == 2 and not (tmp_path / "g.svg").exists()
    assert "graphviz 'dot' program is not installed" in err
    assert "apt-get install graphviz" in err and "--dot FILE" in err


def test_svg_with_dot_renders(capsys, net, tmp_path):
    if shutil.which("dot") is None:
        pytest.skip("graphviz's `dot` program is not installed here: the SVG cannot be "
                    "rendered (the missing-dot message is tested above)")
    rc, _, _ = cli(capsys, *small(net, "--stages", 2, "--svg", tmp_path / "g.svg"))
    assert rc == 0 and "<svg" in (tmp_path / "g.svg").read_text()


# -- --timeline --------------------------------------------------------------------------------
def _by_rank(bars):
    return {r: [b.action for b in bs] for r, bs in bars.items()}


def test_timeline_bars_of_a_two_stage_gpipe(program):
    bars = draw.timeline_bars(program)
    compute = {r: [a for a in acts if a[1] in "FB"] for r, acts in _by_rank(bars).items()}
    assert compute == {0: ["0F0", "0F1", "0B0", "0B1"], 1: ["1F0", "1F1", "1B0", "1B1"]}
    for bs in bars.values():
        assert [b.action for b in bs] == [str(a) for a in program.schedule[bs[0].rank]]
        for prev, b in zip(bs, bs[1:], strict=False):
            assert prev.end <= b.start  # no overlaps on a rank
    sends = {b.action: b for bs in bars.values() for b in bs if b.kind == "send"}
    recvs = [b for bs in bars.values() for b in bs if b.kind == "recv"]
    assert len(recvs) == 4
    for r in recvs:
        peer = "0SEND_F" if "RECV_F" in r.action else "1SEND_B"
        s = sends[f"{peer}{r.mb}"]
        assert r.end >= s.start and r.rank != s.rank
    f0 = {b.action: b.end - b.start for bs in bars.values() for b in bs}
    assert f0["0F0"] == 1 and f0["1B1"] == 2  # unit costs


def test_timeline_with_flop_costs(net):
    _, prog = build(net, dtype=torch.float64)
    costs = stage_costs(prog)
    # per micro-batch of 2: conv 3->4 3x3 on 8x8 | conv 4->2 1x1, linear 128->5
    assert costs == {0: 2 * 2 * 4 * 64 * 3 * 9, 1: 2 * 2 * 2 * 64 * 4 + 2 * 2 * 128 * 5}
    bars = draw.timeline_bars(prog, costs)
    spans = {b.action: b.end - b.start for bs in bars.values() for b in bs}
    assert spans["0F1"] == costs[0] and spans["0B1"] == 2 * costs[0]
    assert spans["1F0"] == costs[1] and spans["1B0"] == 2 * costs[1]
    res = simulate(prog.schedule, {0: {1}, 1: set()}, stage_cost=costs)
    assert res.makespan == max(b.end for bs in bars.values() for b in bs)


def test_timeline_png_has_a_row_per_rank(capsys, net, tmp_path, program):
    f = tmp_path / "t.png"
    rc, out, _ = cli(capsys, *small(net, "--stages", 2, "--microbatches", 2, "--timeline", f))
    assert rc == 0 and f"wrote {f}" in out
    assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(f)
    assert img.ndim == 3 and img.shape[1] > img.shape[0] > 100
    fig = draw.timeline_figure(draw.timeline_bars(program), "t", "x")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    assert len(ax.patches) == sum(len(a) for a in program.schedule.values())


def test_timeline_of_a_zero_bubble_schedule_draws_w_apart(capsys, net, tmp_path):
    """ZB-H1 splits each backward into B (input gradients) and W (weight gradients): W bars
    have their own kind, colour, legend entry and micro-batch number; unit costs F=1, B=W=1."""
    _, prog = build(net, schedule="zero_bubble")
    bars = draw.timeline_bars(prog)
    compute = {r: [a for a in acts if a[1] in "FBW"] for r, acts in _by_rank(bars).items()}
    assert compute == {0: ["0F0", "0F1", "0B0", "0W0", "0B1", "0W1"],
                       1: ["1F0", "1B0", "1F1", "1B1", "1W0", "1W1"]}
    ws = [b for bs in bars.values() for b in bs if b.kind == "W"]
    assert [(b.action, b.stage, b.mb, b.end - b.start) for b in ws] == [
        ("0W0", 0, 0, 1), ("0W1", 0, 1, 1), ("1W0", 1, 0, 1), ("1W1", 1, 1, 1)]
    assert {b.end - b.start for bs in bars.values() for b in bs if b.kind == "B"} == {1}
    assert draw.bar_kind("W") == "W"
    assert len(set(draw.KIND_COLOURS.values())) == len(draw.KIND_COLOURS)
    fig = draw.timeline_figure(bars, "t", "x")
    ax = fig.axes[0]
    assert len(ax.patches) == sum(len(a) for a in prog.schedule.values())
    w_colour = matplotlib.colors.to_rgba(draw.KIND_COLOURS["W"])
    assert sum(p.get_facecolor() == w_colour for p in ax.patches) == 4
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[:3] == ["F (forward)", "B (input gradients)", "W (weight gradients)"]
    assert sorted(t.get_text() for t in ax.texts) == sorted("000111" * 2)  # F, B, W of each
    plain = draw.timeline_figure(draw.timeline_bars(build(net)[1]), "t", "x").axes[0]
    assert [t.get_text() for t in plain.get_legend().get_texts()][:3] == [
        "F (forward)", "B (backward)", "send"]  # no W without a split
    f = tmp_path / "zb.png"
    rc, out, _ = cli(capsys, *small(net, "--stages", 2, "--microbatches", 2, "--schedule",
                                    "zero_bubble", "--timeline", f))
    assert rc == 0 and f"wrote {f}" in out and f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, out, _ = cli(capsys, *small(net, "--stages", 2, "--microbatches", 2, "--schedule",
                                    "zero_bubble"))
    assert rc == 0 and "0W0" in out and "1W1" in out
    # 2 stages, 2 micro-batches: 3m + S - 1 = 7 ticks, each rank busy 3m = 6
    assert "simulated bubble (F=1, B=1, W=1 ticks): 14.3%; one copy's formula " \
        "(p-1)/(3m+p-1) = 14.3%" in out
    rc, out, _ = cli(capsys, *small(net, "--stages", 2, "--microbatches", 2, "--schedule",
                                    "zero_bubble", "--profile", "h100-nvlink-ib"))
    assert rc == 0 and re.search(r"stage 1: F [0-9.]+ ms, B ([0-9.]+) ms, W \1 ms per", out)


def test_bubble_formulas_printed_match_the_simulator():
    from fxpar.cli.inspect import bubble_formula
    from fxpar.core.schedule import chain, pipeline

    for name in ("gpipe", "1f1b", "zero_bubble"):
        for p, m in [(2, 1), (2, 4), (3, 2), (4, 4), (4, 9), (6, 3)]:
            text, value = bubble_formula(name, p, m)
            assert simulate(pipeline(p, m, name), chain(p)).bubble == pytest.approx(value), \
                (name, p, m, text)
    assert bubble_formula("zero_bubble", 3, 2)[0] == "(2p-m-1)/(2m+2p-1) (m < p)"
    for p, v, m in [(4, 2, 2), (4, 2, 4), (6, 3, 4), (8, 2, 8), (8, 4, 4)]:
        sim = simulate(pipeline(p, m, "interleaved_1f1b", per_rank=v), chain(p))
        assert sim.bubble == pytest.approx(bubble_formula("interleaved_1f1b", p, m, v)[1])


METRICS = {
    "fxpar_metrics": 1, "model": "models:amoebanet", "world_size": 2,
    "plan": {"stages": 2, "gems": True}, "steps": 3, "batch_size": 4, "images_per_s": 10.0,
    "ranks": [
        {"rank": r, "roles": [{"copy": 0, "stage": r, "tile": 0}], "peak_memory_bytes": 1,
         "compute_s": 0.1, "comm_s": 0.01, "step_s": 0.2,
         "timeline": [
             {"action": f"{r}F0", "kind": "F", "stage": r, "mb": 0, "copy": 0,
              "start": 0.01 * r, "end": 0.02 + 0.01 * r, "wait": 0.0},
             {"action": f"c1.{1 - r}F0", "kind": "F", "stage": 1 - r, "mb": 0, "copy": 1,
              "start": 0.03, "end": 0.05, "wait": 0.0},
             {"action": "ALLREDUCE", "kind": "ALLREDUCE", "stage": -1, "mb": -1, "copy": 0,
              "start": 0.05, "end": 0.06, "wait": 0.004},
             {"action": "STEP", "kind": "STEP", "stage": -1, "mb": -1, "copy": 0,
              "start": 0.06, "end": 0.061, "wait": 0.0}]}
        for r in range(2)],
}


def test_timeline_from_metrics(capsys, tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(METRICS))
    bars = draw.bars_from_metrics(METRICS)
    assert _by_rank(bars) == {0: ["0F0", "c1.1F0", "ALLREDUCE", "STEP"],
                              1: ["1F0", "c1.0F0", "ALLREDUCE", "STEP"]}
    assert [b.kind for b in bars[1]] == ["F", "F", "allreduce", "step"]
    assert (bars[1][0].start, bars[1][0].end, bars[1][1].copy) == (0.01, 0.03, 1)
    assert bars[0][2].wait == 0.004
    fig = draw.timeline_figure(bars, "t", "s")
    hatched = [p for p in fig.axes[0].patches if p.get_hatch()]
    assert len(hatched) == 2  # the GEMS copy-1 forward of each rank
    assert len(fig.axes[0].patches) == 8 + 2  # one bar per action + each ALLREDUCE's wait
    f = tmp_path / "real.png"
    rc, out, _ = cli(capsys, "--timeline", f, "--from-metrics", path)  # no model needed
    assert rc == 0 and f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    path.write_text(json.dumps({"ranks": []}))
    rc, _, err = cli(capsys, "--timeline", f, "--from-metrics", path)
    assert rc == 2 and "fxpar_metrics" in err


def test_profile_predicts_the_step_and_draws_it_next_to_a_run(capsys, net, tmp_path):
    """--profile: the cost model's step time and per-stage seconds; with --timeline the
    predicted Gantt chart; with --from-metrics too, the prediction above the measured run."""
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({
        "name": "slow", "device": "cpu", "conv_flops": 1e9, "matmul_flops": 1e9,
        "mem_bytes": 1e9, "op_s": 1e-4, "p2p_intra": [1e-3, 1e-9], "p2p_inter": [1e-3, 1e-9],
        "allreduce_intra": [1e-3, 1e-9], "allreduce_inter": [1e-3, 1e-9]}))
    rc, out, _ = cli(capsys, *small(net, "--stages", 2, "--microbatches", 2, "--profile", prof))
    assert rc == 0, out
    step = float(re.search(r"predicted step on 'slow': ([0-9.]+) s, bubble", out).group(1))
    assert step > 4 * 1e-3  # at least the two forward and two backward messages
    assert "stage 0: F " in out and "stage 1: F " in out
    f = tmp_path / "p.png"
    rc, out, _ = cli(capsys, *small(net, "--stages", 2, "--microbatches", 2, "--profile", prof,
                                    "--timeline", f))
    assert rc == 0 and f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run = tmp_path / "run.json"
    run.write_text(json.dumps(METRICS))
    rc, out, _ = cli(capsys, *small(net, "--stages", 2, "--microbatches", 2, "--profile", prof,
                                    "--timeline", f, "--from-metrics", run))
    assert rc == 0 and "above" in out
    rc, _, err = cli(capsys, "--profile", prof, "--timeline", f, "--from-metrics", run)
    assert rc == 2 and "give the run's model" in err
    rc, _, err = cli(capsys, *small(net, "--profile", "no-such"))
    assert rc == 2 and "fxpar-calibrate --out FILE" in err


# -- --memory ----------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule, flight", [("gpipe", (2, 2)), ("1f1b", (2, 1)),
                                              ("zero_bubble", (2, 2))])
def test_memory_matches_a_hand_count(net, schedule, flight):
    _, prog = build(net, schedule=schedule, dtype=torch.float64)
    e = 8  # float64
    mb = 2  # 4 images in 2 micro-batches
    conv1 = (4 * 3 * 9 + 4) * e
    conv2, fc = (2 * 4 + 2) * e, (128 * 5 + 5) * e
    act0 = 2 * mb * 4 * 64 * e  # conv1 and relu outputs
    act1 = (mb * 2 * 64 + mb * 128 + mb * 5) * e  # conv2, flatten, linear
    cut = mb * 4 * 64 * e  # relu's output crosses the cut
    want = [
        memory.RankMemory(0, "c0.s0", conv1, conv1, conv1, act0 * flight[0], cut),
        memory.RankMemory(1, "c0.s1", conv2 + fc, conv2 + fc, conv2 + fc, act1 * flight[1],
                          cut * flight[1]),
    ]
    assert memory.estimate(prog) == want


@pytest.mark.parametrize("stages, m", [(1, 1), (2, 1), (3, 2), (3, 5), (4, 4), (5, 8)])
def test_in_flight_is_read_off_the_schedule(stages, m):
    """F done minus the backwards that free activations (W where the backward is split, else
    B), at its most on each stage: GPipe m, 1F1B min(m, S - s), ZB-H1 min(m, S)."""
    want = {"gpipe": lambda s: m, "1f1b": lambda s: min(m, stages - s),
            "zero_bubble": lambda s: min(m, stages)}
    for name, flight in want.items():
        sched = pipeline(stages, m, name)
        assert memory.schedule_in_flight(sched) == {s: flight(s) for s in range(stages)}, name
    # a split B frees nothing: counted at W; unsplit at B
    F, B, W = (Action(k, 0, 0) for k in "FBW")
    F1, B1 = Action("F", 0, 1), Action("B", 0, 1)
    assert memory.schedule_in_flight({0: [F, B, F1, W, B1]}) == {0: 2}
    assert memory.schedule_in_flight({0: [F, B, W, F1, B1]}) == {0: 1}


def test_in_flight_of_interleaved_1f1b_by_hand():
    """4 stages on 2 ranks (rank 0: stages 0 and 2), 4 micro-batches. Rank 0 warms up with
    4 forwards (0F0 0F1 2F0 2F1), then 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1, then 2B2 2B3 0B2 0B3:
    stage 0 holds all 4 before its first B, stage 2 at most 2. Rank 1: 1F0 1F1, then 3F0 3B0
    3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3, then 1B2 1B3: stage 1 at most 3, stage 3 one."""
    sched = pipeline(4, 4, "interleaved_1f1b", per_rank=2)
    order = {r: " ".join(str(a) for a in acts if a.kind in "FB") for r, acts in sched.items()}
    assert order == {0: "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
                     1: "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"}
    assert memory.schedule_in_flight(sched) == {0: 4, 1: 3, 2: 2, 3: 1}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
def test_in_flight_of_a_gems_program_counts_each_copy(net, schedule):
    """GEMS: each copy's stage holds at most its own copy's micro-batches in flight."""
    _, prog = build(net, schedule=schedule, gems=True)
    assert prog.plan.copies == 2
    per_copy = {c: {s: 0 for s in range(2)} for c in range(2)}
    for acts in prog.schedule.values():
        for c in range(2):
            order = pipeline(2, 2, schedule, copy=c)
            for s in range(2):
                mine = [a for a in acts if a.copy == c and a.stage == s and a.kind in "FBW"]
                if mine:  # the merge keeps each copy's order of a stage's actions
                    assert mine == [a for a in order[s] if a.kind in "FBW"]
                    per_copy[c][s] = memory.schedule_in_flight({0: mine})[s]
    assert [memory.in_flight(prog, s) for s in range(2)] == \
        [max(per_copy[c][s] for c in range(2)) for s in range(2)]


def test_memory_table_in_the_cli(capsys, net):
    rc, out, _ = cli(capsys, *small(net, "--stages", 2, "--microbatches", 2, "--balance", "2,3",
                                    "--schedule", "1f1b", "--memory"))
    assert rc == 0
    assert "SGD with momentum = 1x the trainable parameters" in out
    rows = out.split("allocator overhead\n")[1].splitlines()
    assert rows[0].split() == ["rank", "roles", "params", "grads", "optimizer", "activations",
                               "received", "total"]
    e, mb = 4, 2
    total0 = 3 * (4 * 3 * 9 + 4) * e + 2 * (2 * mb * 4 * 64 * e) + mb * 4 * 64 * e
    assert rows[1].split()[:2] == ["0", "c0.s0"]
    assert " ".join(rows[1].split()[-2:]) == nbytes(total0)


def test_memory_of_a_spatial_stage_splits_tiled_outputs_and_adds_halos(net):
    est = memory.estimate(spatial_program(net))
    assert [m.roles for m in est] == ["c0.s0.t0", "c0.s0.t1", "c0.s1"]
    e, n = 4, 2  # float32, batch 2 (one micro-batch)
    tiled = (3 * n * 4 * 16 * 16 + 2 * n * 4 * 8 * 8) // 2  # conv, bn, relu; pool, conv: 1/P
    whole = n * 256  # flatten, after the join: every tile holds all of it
    # the first conv reads the whole input (a local slice, nothing kept); the pool's 2x2
    # windows lie inside the tiles; the second conv receives one 8-row column of 4 channels
    halo = n * 4 * 8
    assert est[0].activations == (tiled + whole + halo) * e == est[1].activations
    # flatten's output goes to stage 1 from tile 0, so only tile 0 gets its gradient back
    assert (est[0].received, est[1].received, est[2].received) == (whole * e, 0, whole * e)
    conv1 = (4 * 3 * 9 + 4) * e
    bn = 4 * 4 * e + 8  # weight, bias, running mean and var; the int64 batch counter
    assert est[0].params == conv1 + bn + (4 * 4 * 9 + 4) * e
    assert est[0].grads == est[0].optimizer == conv1 + 2 * 4 * e + (4 * 4 * 9 + 4) * e

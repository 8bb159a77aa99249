"""docs/gpu.md from what tools/gpu_check.py measured: one table per section, a row per item,
"not measured: ..." where a section's worker stopped before reaching it."""

from __future__ import annotations

from typing import Any

DASH = "–"


def _ms(s: dict[str, float]) -> str:
    return f"{s['median']:.1f} ({s['min']:.1f}{DASH}{s['max']:.1f})"


def _cell(v: Any) -> str:
    return " ".join(str(v).split()).replace("|", "\\|")


def _table(columns: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(map(_cell, r)) + " |" for r in rows])


def _missing(sec: dict[str, Any]) -> str:
    return f"not measured: {sec['why'] or 'the worker printed nothing'}"


def _by_item(sec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["item"]: r for r in sec["records"] if "item" in r}


def test_counts(tests: dict[str, Any]) -> str:
    counts: dict[str, int] = {}
    for t in tests["tests"]:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    text = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none reported"
    return text + (f", stopped after {tests['budget']:.0f} s" if tests["stopped"] else "")


def _header(f: dict[str, Any]) -> str:
    gpu, seen = f["gpu"], f["seen"]
    device = (f"{gpu.get('name') or seen.get('device', '?')}, "
              f"{gpu.get('memory') or format(seen.get('memory_gib', 0), '.1f') + ' GiB'}"
              if f["device"] == "cuda" else "CPU (no GPU used)")
    cudnn = f", cuDNN {seen['cudnn']}" if seen.get("cudnn") else ""
    s = f["sizes"]
    run = (f"{'quick (tiny sizes: the code paths, not a measurement)' if f['quick'] else 'full'}"
           f" on {f['device']}: {f['seconds']:.0f} s of the {f['deadline']:.0f} s deadline")
    rows = [["device", device], ["driver", gpu.get("driver") or seen.get("driver", DASH)],
            ["torch", f"{f['torch']} (CUDA {f['cuda'] or DASH}{cudnn})"],
            ["fxpar", f"commit {f['commit']}"], ["date", f["date"]], ["run", run],
            ["set-up", "; ".join(f["setup"])]]
    return "\n\n".join([
        "# fxpar on a GPU node",
        "Written by `make gpu-check` (tools/gpu_check.py, tools/gpu_measure.py) in one run; "
        "every figure below comes from that run. Times are medians over the timed steps with "
        "their range in brackets; on a GPU each step is timed between two "
        f"`torch.cuda.synchronize()` calls ({s['warmup']} untimed warm-up step(s) first, "
        f"then {s['steps']} timed).",
        _table(["what", "value"], rows)])


def _tests(tests: dict[str, Any] | None) -> str:
    head = "## Transparency tests on the GPU"
    if tests is None:
        return f"{head}\n\nnot run (--skip-tests)"
    text = (f"`tests/mpi/test_gpu.py` under pytest (the cases run under mpiexec with 5 ranks "
            f"sharing the GPU, float64): {test_counts(tests)}, in {tests['seconds']:.0f} s "
            f"(budget {tests['budget']:.0f} s).")
    if tests["stopped"]:
        text += (" Tests pytest had not reported when it was stopped are not listed: not "
                 f"measured: out of time ({tests['budget']:.0f} s).")
    rows = [[t["test"], t["outcome"], t["why"] or DASH] for t in tests["tests"]]
    if not rows:
        return f"{head}\n\n{text}\n\n```\n{tests['tail'][-1500:]}\n```"
    return f"{head}\n\n{text}\n\n" + _table(["test", "result", "note"], rows)


def _single(sec: dict[str, Any], s: dict[str, Any], dev: str) -> str:
    head = "## One rank: fxpar's program vs the eager loop"
    note = ("`fxpar.compile(model, Plan(precision=P, channels_last=True), ...).for_rank(0)"
            ".train_step(x, y)` against the loop a user writes (zero_grad, forward and "
            "cross-entropy under `torch.autocast` for bf16, backward, SGD step) on a deep copy "
            "of the same model, channels-last input, the two interleaved step by step. In fp32 "
            "their losses must agree (last column).")
    got = _by_item(sec)
    rows = []
    for name, side, n in s["single"]:
        for prec in s["precisions"]:
            r = got.get(f"{name}/{prec}")
            if r is None or "error" in r:
                why = f"failed: {r['error']}" if r else _missing(sec)
                rows.append([name, f"{side}²", n, prec, why, "", "", "", ""])
                continue
            rows.append([name, f"{side}²", n, prec, _ms(r["eager_ms"]), _ms(r["fxpar_ms"]),
                         f"{r['ratio']:.3f}", f"{r['compile_s']:.1f}",
                         f"{r['max_loss_diff']:.1e}"])
    return f"{head}\n\n{note}\n\n" + _table(
        ["model", "image", "batch", "precision", "eager step ms", "fxpar step ms",
         "fxpar / eager", "compile s", "max loss diff"], rows)


def _sp(sec: dict[str, Any], s: dict[str, Any], dev: str) -> str:
    head = "## Spatial parallelism with the ranks sharing one GPU"
    got = _by_item(sec)
    check, over = [], []
    cm, cs, cn = s["check"]
    om, os_, on = s["overhead"]
    for p in s["parts"]:
        c, t = got.get(f"sp{p}/check"), got.get(f"sp{p}/time")
        check.append([f"SP{p}", cm, f"{cs}² x {cn}"] + (
            [f"{c['loss_diff']:.1e}", f"{c['grad_diff']:.1e}", f"{c['param_diff']:.1e}",
             f"{c['buffer_diff']:.1e}", f"{c['grad_max']:.2f}"] if c else
            [_missing(sec), "", "", "", ""]))
        over.append([f"SP{p}", om, f"{os_}² x {on}"] + (
            [_ms(t["one_ms"]), _ms(t["sp_ms"]), f"{t['ratio']:.2f}", f"{t['overhead_ms']:.1f}"]
            if t else [_missing(sec), "", "", ""]))
    return "\n\n".join([
        head,
        f"`mpiexec -n P` with `Plan(spatial_parts=P)` (square tiles); every rank computes on the "
        f"same {dev}. **Correctness**: one SGD step in float64 of the compiled program and of the "
        "original model in one process (on rank 0, from the same weights and batch): the "
        "largest absolute difference of the loss, of every gradient and parameter after the "
        "step, and of every buffer (BatchNorm statistics).",
        _table(["plan", "model", "image x batch", "loss", "gradients", "parameters",
                "buffers", "largest gradient"], check),
        "**Overhead**: fp32 steps of SP-P against one process training the original model "
        f"on the same {dev} (rank 0, the other ranks waiting). The P ranks share the {dev}, so "
        "the SP step cannot be faster: the difference is what tiling costs (halos through host "
        "buffers when the MPI is not CUDA-aware, BatchNorm statistics, the join, smaller "
        "kernels).",
        _table(["plan", "model", "image x batch", "one process ms", "SP ms",
                "SP / one process", "overhead ms per step"], over)])


def _largest(sec: dict[str, Any], s: dict[str, Any], dev: str) -> str:
    head = "## The largest image one GPU trains"
    systems = {"eager": "one process, eager fp32",
               "sp": f"SP{s['largest_parts']} + bf16 + {s['segments']} recompute segments"}
    rows, best = [], {}
    for key, label in systems.items():
        recs = [r for r in sec["records"] if r.get("item") == key]
        ok = [r for r in recs if r.get("ok")]
        failed = [r for r in recs if r.get("ok") is False]
        stopped = [r["stopped"] for r in recs if "stopped" in r]
        ended = (f"out of memory at {failed[0]['side']}²" if failed else
                 stopped[0] if stopped else sec["why"] or "?")
        if not ok:
            rows.append([label, _missing(sec), "", "", "", ended])
            continue
        r = max(ok, key=lambda r: r["side"])
        best[key] = r["side"]
        rows.append([label, str(r["side"]), str(r["side"] ** 2),
                     f"{r['peak_gib']:.1f}" if r["peak_gib"] else DASH,
                     f"{r['step_s']:.2f}", ended])
    ratio = ""
    if len(best) == 2:
        gain = best["sp"] ** 2 / best["eager"] ** 2
        ratio = (f"\n\nSP with bf16 and recompute trains {gain:.2f}x the pixels of one process "
                 f"(a search that ended by its size limit or time cap gives a lower bound).")
    return "\n\n".join([
        head,
        f"Model: the repository's U-Net (base channels {s['unet'][0]}, depth "
        f"{s['unet'][1]}), one image per step, per-pixel cross-entropy, SGD. Sides from "
        f"{s['largest_start']} up, twice the pixels each time (multiples of 32); one train "
        "step each until an out-of-memory error, the size limit, or the time cap. SP starts "
        "where one process stopped. Peak: `torch.cuda.max_memory_allocated` (summed over the "
        "ranks for SP).",
        _table(["system", "largest side trained", "pixels", "peak GiB", "step s",
                "search ended by"], rows) + ratio])


def _predict(sec: dict[str, Any], s: dict[str, Any], dev: str) -> str:
    size = s["predict_size"]
    head = f"## Inference on a {size}² tiled TIFF: fxpar.predict vs MONAI"
    got = _by_item(sec)
    image = got.get("image")
    rows = []
    labels = [("exact", "whole-image forward (the reference)"),
              ("fxpar", f"fxpar.predict region loop, one rank, regions {s['predict_region']}²"),
              *((f"monai/{m}", f"MONAI sliding_window_inference, mode {m}, overlap "
                 f"{s['monai_overlap']}") for m in s["monai_modes"])]
    for key, label in labels:
        r = got.get(key) or (got.get("monai") if key.startswith("monai") else None)
        if r is None:
            rows.append([label, _missing(sec), "", ""])
        elif "error" in r:
            rows.append([label, f"failed: {r['error']}", "", ""])
        elif "missing" in r:
            lib = "MONAI" if key.startswith("monai") else "zarr"
            rows.append([label, f"not measured: {lib} is not importable here ({r['missing']}): "
                         f"carry its wheels in .gpu-wheels/ (README, Checking a GPU node)", "",
                         ""])
        else:
            rows.append([label, f"{r['mpx_s']:.2f}", f"{r['seconds']:.2f}",
                         "0 (the reference)" if key == "exact" else str(r["differ"])])
    made = (f"{image['bytes'] / 2**20:.1f} MiB, written in {image['seconds']:.1f} s"
            if image else "not written")
    return "\n\n".join([
        head,
        f"Image: tools/bench_predict.py's synthetic RGB uint8 image, a tiled (512² tiles) "
        f"zlib BigTIFF ({made}); model: its `SegNet` (3 classes, BatchNorm statistics from "
        f"training-mode forwards), float32, eval, no_grad, on the {dev}. fxpar: "
        "`fxpar.compiler.predict.predict_regions` (what fxpar-predict runs) with each region's "
        f"program moved to the {dev} (fxpar-predict itself has no device option), reading the "
        "TIFF window by window and writing the argmax to a .zarr; its seconds exclude compiling. "
        f"MONAI: the image in {dev} memory (no reading, no writing). Last column: pixels whose "
        f"class (argmax) differs from the whole-image forward on the same {dev}.",
        _table(["system", "Mpx/s", "seconds", "pixels whose class differs"], rows)])


def render(facts: dict[str, Any], tests: dict[str, Any] | None,
           sections: dict[str, dict[str, Any]]) -> str:
    s = facts["sizes"]
    seen = next((r for r in sections["single"]["records"] if r.get("item") == "device"), {})
    facts = {**facts, "seen": seen}
    parts = [_header(facts), _tests(tests)]
    dev = "GPU" if facts["device"] == "cuda" else "CPU"
    for name, fn in (("single", _single), ("sp", _sp), ("largest", _largest),
                     ("predict", _predict)):
        sec = sections[name]
        text = fn(sec, s, dev)
        if sec["why"] and sec["records"]:
            text += f"\n\nThis section stopped early: {sec['why']}."
        parts.append(text + f"\n\n(section: {sec['seconds']:.0f} s of its {sec['cap']:.0f} s cap)")
    return "\n\n".join(parts) + "\n"

"""fxpar's benchmark suite: one entry point, one JSON file, one generated page.

    python tools/bench.py                          # every section, 5 rounds each
    python tools/bench.py --only single --rounds 3 # measure one section, merge it into --out
    python tools/bench.py --report-only            # re-render docs/benchmarks.md from the JSON

Each section is a module ``tools/bench_<name>.py`` (``TITLE``, ``add_args(parser)``,
``run(opts) -> Section``; the contract is in ``tools/benchlib.py``, whose ``compare`` makes a
plain comparison's whole section from its systems and the limit: one function). Sections run
at different times live side by side in ``--out``: re-running some with ``--only`` replaces
just those, and each keeps its own command, date and revision, so the page says what was
measured when.

The page is generated, so hand-written analysis does not go into it: put it in
``docs/bench_notes/<name>.md`` (next to ``--md``), which every render appends under that
section. Plots are PNGs (matplotlib, Agg) under ``docs/bench/``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
ORDER = ("single", "compile", "spatial", "pipeline")  # page order; other sections follow
FORMAT = 1
sys.path.insert(0, str(TOOLS))  # benchlib, and the sections' own `import benchlib`


# -- sections -----------------------------------------------------------------------------------
def discover(tools: Path = TOOLS) -> dict[str, Path]:
    """``{name: path}`` of every ``bench_<name>.py`` in ``tools``, in page order."""
    found = {p.stem.removeprefix("bench_"): p for p in tools.glob("bench_*.py")}
    return {n: found[n] for n in sorted(found, key=_rank)}


def _rank(name: str) -> tuple[int, str]:
    return (ORDER.index(name) if name in ORDER else len(ORDER), name)


def load(name: str, path: Path) -> ModuleType:
    """Import ``tools/bench_<name>.py`` by path (tools/ is not a package)."""
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))  # so the module can `import benchlib`
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def check_section(sec: Any, where: str = "section") -> dict[str, Any]:
    """Raise ValueError, saying what to fix, unless ``sec`` looks like a Section."""
    if not isinstance(sec, dict) or not isinstance(sec.get("name"), str) or "title" not in sec:
        raise ValueError(f"{where}: run() must return a dict with at least 'name' and 'title' "
                         f"(see tools/benchlib.py), got {type(sec).__name__}")
    for t in sec.get("tables", []):
        cols = t.get("columns", [])
        for row in t.get("rows", []):
            if len(row) != len(cols):
                raise ValueError(f"{where}: table {t.get('title')!r} has {len(cols)} columns but "
                                 f"a row of {len(row)} cells: {row!r}")
    for p in sec.get("plots", []):
        if not str(p.get("file", "")).endswith(".png") or "/" in str(p.get("file")):
            raise ValueError(f"{where}: plot file {p.get('file')!r} must be a bare name ending "
                             f"in .png (it is written under the plots folder)")
        if p.get("kind", "line") not in ("line", "bar", "scatter"):
            raise ValueError(f"{where}: plot {p['file']} kind must be 'line', 'bar' or "
                             f"'scatter'")
    for a in sec.get("aims", []):
        missing = {"what", "aim", "measured", "met"} - set(a)
        if missing:
            raise ValueError(f"{where}: aim {a!r} lacks {sorted(missing)}")
    return sec


# -- provenance ---------------------------------------------------------------------------------
def revision() -> str:
    """Short HEAD, with ``+dirty`` when tracked files differ from it (untracked ones do not
    count: they are not part of what ran unless imported, and new tools always are). The
    results this script writes under docs/ do not count either: a run of several sections
    rewrites them after the first, and they are not code."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ".", ":(exclude)docs"],
                               cwd=ROOT, check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty.strip() else "")


def command_line(argv: list[str]) -> str:
    """The command as typed from the repository root, for the page's "reproduce" lines."""
    script = os.path.relpath(Path(__file__).resolve(), Path.cwd())
    return shlex.join(["python", script, *argv])


def merge(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``old`` with the sections named in ``new`` replaced (or added), in page order."""
    by_name = {s["name"]: s for s in old}
    by_name.update({s["name"]: s for s in new})
    return [by_name[n] for n in sorted(by_name, key=_rank)]


def read_doc(path: Path) -> dict[str, Any]:
    """The JSON at ``path``, or an empty document when there is none yet."""
    if not path.exists():
        return {"fxpar_bench": FORMAT, "sections": []}
    doc = json.loads(path.read_text())
    if doc.get("fxpar_bench") != FORMAT:
        raise SystemExit(f"{path} is not an fxpar benchmark file (format {FORMAT}); pass "
                         f"another --out or move it away")
    return doc


def write_doc(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)  # a crash mid-write never loses the sections measured before


# -- rendering ----------------------------------------------------------------------------------
def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def table_md(t: dict[str, Any]) -> str:
    """A markdown table; numeric columns right-aligned."""
    cols, rows = t.get("columns", []), t.get("rows", [])
    numeric = [bool(rows) and all(isinstance(r[i], int | float) for r in rows)
               for i in range(len(cols))]
    lines = ["| " + " | ".join(_cell(c) for c in cols) + " |",
             "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def draw(plot: dict[str, Any], path: Path) -> None:
    """One PNG: ``line`` series over x, ``bar``: grouped bars over the x values in order, or
    ``scatter``: points (with ``diagonal``, the line y = x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=100)
    series = plot.get("series", {})
    if plot.get("kind", "line") == "bar":
        xs: list[Any] = []
        for pts in series.values():
            xs += [x for x, _ in pts if x not in xs]
        width = 0.8 / max(1, len(series))
        for k, (label, pts) in enumerate(series.items()):
            ys = dict((x, y) for x, y in pts)
            pos = [i + (k - (len(series) - 1) / 2) * width for i, x in enumerate(xs) if x in ys]
            ax.bar(pos, [ys[x] for x in xs if x in ys], width, label=label)
        ax.set_xticks(range(len(xs)), [str(x) for x in xs])
    elif plot.get("kind") == "scatter":  # points; ``diagonal``: the line y = x
        for label, pts in series.items():
            ax.scatter([x for x, _ in pts], [y for _, y in pts], label=label, s=18)
        if plot.get("diagonal"):
            top = max((max(x, y) for pts in series.values() for x, y in pts), default=1.0)
            ax.plot([0, top * 1.05], [0, top * 1.05], color="grey", linestyle="--",
                    linewidth=1, label="y = x")
    else:
        for label, pts in series.items():
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
    for axis in ("x", "y"):
        if plot.get(f"{axis}scale"):
            getattr(ax, f"set_{axis}scale")(plot[f"{axis}scale"])
    if plot.get("hline") is not None:  # e.g. the aim
        ax.axhline(plot["hline"], color="grey", linestyle="--", linewidth=1)
    ax.set_title(plot.get("title", ""))
    ax.set_xlabel(plot.get("xlabel", ""))
    ax.set_ylabel(plot.get("ylabel", ""))
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _met(a: dict[str, Any]) -> str:
    return {True: "met", False: "**missed**"}.get(a.get("met"), "not measured")


def _machine_line(m: dict[str, Any] | None) -> str:
    if not m:
        return "unknown"
    gpu = m.get("cuda") or "no GPU"
    return (f"{m.get('nproc')} cores, {m.get('cpu')}, {gpu}, torch {m.get('torch')}, "
            f"Python {m.get('python')}")


INTRO = """\
# Benchmarks

Generated by `tools/bench.py` from `{json}`; do not edit this page by hand (the next render
overwrites it). Analysis written by people goes in `{notes}/<section>.md`, which every render
appends under its section.

## How to reproduce

```console
python tools/bench.py                                # every section (see --help for options)
python tools/bench.py --only single,compile --rounds 5   # some sections, merged into the JSON
python tools/bench.py --quick --out /tmp/b.json --md /tmp/b.md   # a few-minute smoke run
python tools/bench.py --report-only                  # re-render this page from the JSON
```

Machine of the latest run: {machine}. Each section names its own command, date, revision
and, where it differs, machine.

Noise: the machines are small shared VMs, so every comparison measures all its systems in the
same round, each as a fresh process, in an order rotated from round to round; before each
launch the driver waits for a quiet machine, and a launch during which other processes used
more than `--max-foreign` cores is redone (`--retries` times). Tables give the median over
rounds and the min-max range; ratios are taken per round, then summarised the same way.
"""


def render(doc: dict[str, Any], md: Path, plots: Path, notes: Path,
           json_path: Path | None = None) -> str:
    """The whole page for ``doc``; writes the plots under ``plots`` on the way."""
    def rel(p: Path) -> str:
        return os.path.relpath(p, md.parent)

    out = [INTRO.format(json=rel(json_path) if json_path else "the JSON", notes=rel(notes),
                        machine=_machine_line(doc.get("machine")))]
    sections = [check_section(s, f"section {s.get('name')!r}") for s in doc.get("sections", [])]
    out.append("## Aims\n")
    aims = [(s, a) for s in sections for a in s.get("aims", [])]
    if aims:
        out.append(table_md({"columns": ["section", "what", "aim", "measured", "met"],
                             "rows": [[s["name"] + (" (quick)" if s.get("quick") else ""),
                                       a["what"], a["aim"], a["measured"], _met(a)]
                                      for s, a in aims]}) + "\n")
    else:
        out.append("No section has an aim yet.\n")
    for s in sections:
        out.append(section_md(s, doc, md, plots, notes))
    return "\n".join(out).rstrip() + "\n"


def section_md(s: dict[str, Any], doc: dict[str, Any], md: Path, plots: Path,
               notes: Path) -> str:
    """One section: provenance, method, tables, plots, aims, notes (generated + hand-written)."""
    out = [f"## {s['title']}\n"]
    out.append(f"Measured {s.get('date', '?')} on fxpar {s.get('revision', '?')} with "
               f"`{s.get('command', '?')}`.\n")
    if s.get("quick"):
        out.append("**Smoke run (`--quick`)**: a tiny configuration that checks the plumbing; "
                   "its numbers are not the benchmark.\n")
    if s.get("machine") and s.get("machine") != doc.get("machine"):
        out.append(f"Machine: {_machine_line(s['machine'])}.\n")
    if "gpu" in s:
        gpu = s["gpu"]
        out.append("GPU: not measured.\n" if gpu in (None, "", "not measured")
                   else f"GPU: {gpu}\n")
    if s.get("method"):
        out.append(s["method"].strip() + "\n")
    for t in s.get("tables", []):
        if t.get("title"):
            out.append(f"### {t['title']}\n")
        out.append(table_md(t) + "\n")
    for p in s.get("plots", []):
        path = plots / p["file"]
        draw(p, path)
        out.append(f"![{p.get('title', '')}]({os.path.relpath(path, md.parent)})\n")
    if s.get("aims"):
        out.append("### Aims\n")
        for a in s["aims"]:
            why = f" {a['why'].strip()}" if a.get("why") else ""
            out.append(f"- {a['what']}: aim {a['aim']}, measured {a['measured']}: "
                       f"{_met(a)}.{why}")
        out.append("")
    hand = notes / f"{s['name']}.md"
    if s.get("notes") or hand.exists():
        out.append("### Notes\n")
        if s.get("notes"):
            out.append(s["notes"].strip() + "\n")
        if hand.exists():
            out.append(hand.read_text().strip() + "\n")
    return "\n".join(out)


# -- driver -------------------------------------------------------------------------------------
def parser(modules: dict[str, ModuleType]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help=f"comma-separated sections (default: all of "
                   f"{','.join(modules)})")
    p.add_argument("--rounds", type=int, default=5, help="rounds per section (fresh processes)")
    p.add_argument("--quick", action="store_true",
                   help="tiny smoke configuration of every section (checks the plumbing)")
    p.add_argument("--max-foreign", type=float, default=0.25,
                   help="redo a launch during which other processes used more cores than this")
    p.add_argument("--retries", type=int, default=3, help="redos per launch (see --max-foreign)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per worker launch")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench.json")
    p.add_argument("--md", type=Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--plots", type=Path, default=None, help="PNG folder (default: bench/ "
                   "next to --md)")
    p.add_argument("--notes", type=Path, default=None, help="hand-written notes folder "
                   "(default: bench_notes/ next to --md)")
    p.add_argument("--report-only", action="store_true", help="render --md from --out only")
    p.add_argument("--tools", type=Path, default=TOOLS, help=argparse.SUPPRESS)  # tests
    for name, mod in modules.items():
        if hasattr(mod, "add_args"):
            try:
                mod.add_args(p)
            except argparse.ArgumentError as e:
                raise SystemExit(f"tools/bench_{name}.py add_args: {e}; prefix its options "
                                 f"with --{name}-") from None
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--tools", type=Path, default=TOOLS)
    pre.add_argument("--only", default="")
    pre.add_argument("--report-only", action="store_true")
    early, _ = pre.parse_known_args(argv)
    found = discover(early.tools)
    wanted = [n.strip() for n in early.only.split(",") if n.strip()] or list(found)
    unknown = [n for n in wanted if n not in found]
    if unknown and not early.report_only:
        raise SystemExit(f"no section {', '.join(unknown)}: the sections are "
                         f"{', '.join(found)} (files tools/bench_<name>.py)")
    modules: dict[str, ModuleType] = {}
    for name, path in found.items():
        try:
            modules[name] = load(name, path)
        except Exception as e:  # a broken module must not block the others' options
            if name in wanted and not early.report_only:
                raise
            print(f"bench: skipping {path.name} ({type(e).__name__}: {e})", file=sys.stderr)
    opts = parser(modules).parse_args(argv)
    plots = opts.plots or opts.md.parent / "bench"
    notes = opts.notes or opts.md.parent / "bench_notes"
    doc = read_doc(opts.out)
    failed = []
    if not opts.report_only:
        import benchlib

        cmd, rev = command_line(argv), revision()
        today = datetime.date.today().isoformat()
        mach = benchlib.machine()
        doc.update(fxpar_bench=FORMAT, date=today, revision=rev, command=cmd, machine=mach)
        for name in wanted:
            t0 = time.time()
            print(f"bench: section {name} ({opts.rounds} rounds{', quick' if opts.quick else ''})",
                  file=sys.stderr, flush=True)
            try:
                sec = check_section(modules[name].run(opts), f"tools/bench_{name}.py run()")
            except Exception:
                traceback.print_exc()
                print(f"bench: section {name} FAILED after {time.time() - t0:.0f} s; the "
                      f"previous result (if any) is kept", file=sys.stderr, flush=True)
                failed.append(name)
                continue
            sec.update(name=name, command=cmd, date=today, revision=rev, machine=mach,
                       quick=opts.quick, rounds=opts.rounds)
            sec.setdefault("title", getattr(modules[name], "TITLE", name))
            doc["sections"] = merge(doc.get("sections", []), [sec])
            write_doc(opts.out, doc)
            print(f"bench: section {name} done in {time.time() - t0:.0f} s -> {opts.out}",
                  file=sys.stderr, flush=True)
    if not doc.get("sections"):
        raise SystemExit(f"{opts.out} holds no sections to render: run some first "
                         f"(e.g. --only single)")
    opts.md.parent.mkdir(parents=True, exist_ok=True)
    opts.md.write_text(render(doc, opts.md, plots, notes, opts.out))
    print(f"bench: wrote {opts.md} ({len(doc['sections'])} sections)", file=sys.stderr)
    if failed:
        print(f"bench: failed sections: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Scaling study on paper: ResNet-101 and AmoebaNet-D (18, 416) at 8192^2 and 16384^2 on 8 to
2,048 H100s, predicted by fxpar's cost model (the shipped ``h100-nvlink-ib`` profile), per plan
family, next to Hy-Fi's published ratios. Rewrites the generated block of ``docs/scaling.md``
and its plots.

For every world size w (powers of two up to 2,048) the planner's enumeration
(``fxpar.planner.planner.candidates``) is costed in closed form with the memory limit
(80 GiB per GPU; a plan over it is tried again with every stage recomputed), each family's
fastest few are simulated, and a family's figure at G GPUs is its best plan on at most G of
them (a family that cannot use more GPUs keeps its best). Families:

- LP: stages >= 2, one micro-batch, no tiles, no GEMS (data parallelism allowed in all);
- PP: stages >= 2, several micro-batches, no tiles, no GEMS;
- SP+LP: tiles, one micro-batch, no GEMS;  SP+PP: tiles, stages >= 2, micro-batches, no GEMS;
- 5-D: tiles, stages >= 2, micro-batches, GEMS and data parallelism together;
- planner: the best plan of all.

    python tools/scaling.py [--quick] [--out docs/scaling.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fxpar.core.plan import Plan  # noqa: E402
from fxpar.models.zoo import build_model  # noqa: E402
from fxpar.perf.profile import Profile  # noqa: E402
from fxpar.planner.planner import EXACT, _cost, candidates, describe  # noqa: E402
from fxpar.planner.planspace import Estimate, ModelTable, analyse, evaluate  # noqa: E402

MODELS = {"ResNet-101": ("torchvision:resnet101", {"num_classes": 1000}),
          "AmoebaNet-D (18, 416)": ("models:amoebanet", {"num_classes": 1000, "num_layers": 18,
                                                        "num_filters": 416})}
IMAGES = (8192, 16384)
GPUS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
BATCH = 8
MEMORY = 80 * 2**30
FAMILIES: dict[str, Callable[[Plan], bool]] = {
    "LP": lambda p: p.stages >= 2 and p.microbatches == 1 and not p.spatial and not p.gems,
    "PP": lambda p: p.stages >= 2 and p.microbatches > 1 and not p.spatial and not p.gems,
    "SP+LP": lambda p: p.spatial and p.microbatches == 1 and not p.gems,
    "SP+PP": lambda p: p.spatial and p.stages >= 2 and p.microbatches > 1 and not p.gems,
    "5-D": lambda p: p.spatial and p.stages >= 2 and p.microbatches > 1 and p.gems
    and p.data_parallel > 1,
    "planner": lambda p: True,
}
START, END = "<!-- scaling tables -->", "<!-- end of scaling tables -->"
SIMULATED = 4
"""Fastest plans per family and world size (closed form) that the timed simulator ranks."""


def best_per_family(table: ModelTable, world: int) -> dict[str, Estimate]:
    """Each family's fastest plan that fits on exactly ``world`` GPUs."""
    plans, _ = candidates(world, BATCH, 2, 8)
    fits, _ = _cost(table, plans, MEMORY)
    fits.sort(key=lambda e: e.step_s)
    tried = {e.plan for e in fits[:EXACT]}  # what plan_auto simulates, and each family's best
    for member in FAMILIES.values():
        tried |= {e.plan for e in [e for e in fits if member(e.plan)][:SIMULATED]}
    exact = [x for p in tried if (x := evaluate(table, p)) is not None]
    out: dict[str, Estimate] = {}
    for name, member in FAMILIES.items():
        mine = [e for e in exact if member(e.plan)]
        if mine:
            out[name] = min(mine, key=lambda e: e.step_s)
    return out


def study(profile: Profile, quick: bool) -> dict[tuple[str, int], dict[int, dict[str, Estimate]]]:
    """(model, image) -> G -> family -> the best plan on at most G GPUs."""
    out = {}
    models = list(MODELS.items())[:1] if quick else list(MODELS.items())
    images = IMAGES[:1] if quick else IMAGES
    gpus = GPUS[:3] if quick else GPUS
    for name, (spec, kw) in models:
        for image in images:
            t0 = time.perf_counter()
            table = analyse(build_model(spec, meta=True, **kw), (BATCH, 3, image, image),
                            profile)
            per_world = {w: best_per_family(table, w) for w in (1, 2, 4, *gpus)}
            best: dict[int, dict[str, Estimate]] = {}
            for g in gpus:
                best[g] = {}
                for fam in FAMILIES:
                    options = [per_world[w][fam] for w in per_world if w <= g
                               and fam in per_world[w]]
                    if options:
                        best[g][fam] = min(options, key=lambda e: e.step_s)
            out[(name, image)] = best
            print(f"{name} {image}^2: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return out


def _cell(e: Estimate | None) -> str:
    return "-" if e is None else f"{BATCH / e.step_s:.2f}"


def _mem(e: Estimate | None) -> str:
    return "-" if e is None else f"{e.memory / 2**30:.1f}"


def tables(results: dict) -> str:
    lines = []
    for (name, image), best in results.items():
        lines += [f"### {name}, {image}x{image}, batch {BATCH}", "",
                  "Predicted images/s (GPUs used by the family's best plan in brackets):", "",
                  "| GPUs | " + " | ".join(FAMILIES) + " | SP+LP / LP | SP+PP / PP |",
                  "|---|" + "---|" * (len(FAMILIES) + 2)]
        for g, fams in best.items():
            cells = [f"{_cell(fams.get(f))} ({fams[f].plan.world_size})" if f in fams else "-"
                     for f in FAMILIES]
            r1 = _ratio(fams, "SP+LP", "LP")
            r2 = _ratio(fams, "SP+PP", "PP")
            lines.append(f"| {g} | " + " | ".join(cells) + f" | {r1} | {r2} |")
        lines += ["", "Peak memory per GPU of those plans (GiB), and the planner's choice:", "",
                  "| GPUs | " + " | ".join(FAMILIES) + " | planner's plan |",
                  "|---|" + "---|" * (len(FAMILIES) + 1)]
        for g, fams in best.items():
            plan = describe(fams["planner"].plan) if "planner" in fams else "-"
            lines.append(f"| {g} | " + " | ".join(_mem(fams.get(f)) for f in FAMILIES) +
                         f" | {plan} |")
        lines.append("")
    return "\n".join(lines)


def _ratio(fams: dict[str, Estimate], a: str, b: str) -> str:
    if a not in fams or b not in fams:
        return "-"
    return f"{fams[b].step_s / fams[a].step_s:.2f}x"


def plots(results: dict, folder: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for what, fn, ylabel in (("throughput", lambda e: BATCH / e.step_s, "predicted images/s"),
                             ("memory", lambda e: e.memory / 2**30,
                              "peak memory per GPU (GiB)")):
        fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.6),
                                 squeeze=False)
        for ax, ((name, image), best) in zip(axes[0], results.items(), strict=True):
            for i, fam in enumerate(FAMILIES):  # one colour per family on every panel
                xs = [g for g in best if fam in best[g]]
                ax.plot(xs, [fn(best[g][fam]) for g in xs], marker="o", ms=3, label=fam,
                        color=f"C{i}", lw=2.5 if fam == "planner" else 1.2,
                        alpha=0.5 if fam == "planner" else 1.0)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{name}\n{image}x{image}", fontsize=9)
            ax.set_xlabel("GPUs (H100)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        file = f"scaling_{what}.png"
        fig.savefig(folder / file, dpi=110)
        plt.close(fig)
        names.append(file)
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "scaling.md",
                   help="the page whose generated block (between the markers) is replaced")
    p.add_argument("--plots", type=Path, default=ROOT / "docs" / "bench")
    a = p.parse_args(argv)
    profile = Profile.load("h100-nvlink-ib")
    t0 = time.perf_counter()
    results = study(profile, a.quick)
    a.plots.mkdir(parents=True, exist_ok=True)
    files = plots(results, a.plots)
    block = (f"{START}\n<!-- written by `python tools/scaling.py` in "
             f"{time.perf_counter() - t0:.0f} s; edit the text around it, not this -->\n\n"
             f"{tables(results)}\n{END}")
    old = a.out.read_text() if a.out.exists() else f"# Scaling study on paper\n\n{START}\n{END}\n"
    if START not in old or END not in old:
        raise SystemExit(f"{a.out} has no {START} ... {END} block to replace")
    head, rest = old.split(START, 1)
    a.out.write_text(head + block + rest.split(END, 1)[1])
    print(f"wrote {a.out} and {', '.join(str(a.plots / f) for f in files)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The public-model matrix: every model of tests/mpi/cases/library_cases.py under every plan, each
trained compiled and on one process in float64 under one real ``mpiexec`` (loss, every
gradient, parameters after 2 SGD steps with momentum, every buffer, full_state_dict, eval
output), with the spatial coverage of each SP plan. Writes docs/models.md.

    python tools/models_matrix.py                 # the whole matrix (~20 min on 2 cores)
    python tools/models_matrix.py --only smp_Unet # one model's row
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "mpi")]

from cases.library_cases import MODELS, PLANS  # noqa: E402

from fxpar.testing import run_cases  # noqa: E402

PLAN_TEXT = {
    "one": "1 rank",
    "sp2": "SP2 vertical",
    "sp4": "SP4 square",
    "pp2": "PP2 1F1B m=2",
    "sp2_pp": "SP2+PP (3 ranks)",
    "sp2_dp2": "SP2+DP2",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", help="model key(s) to run (default: all)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "models.md"))
    args = ap.parse_args(argv)
    models = args.only or list(MODELS)
    t0 = time.perf_counter()
    results = {}
    for m in models:  # one launch per model: a failing case ends its launch, not the matrix
        cases = [f"{TESTS / 'mpi' / 'cases' / 'library_cases.py'}::case_{m}__{p}" for p in PLANS]
        results.update(run_cases(cases, n=4, timeout=1800, pythonpath=[TESTS]))
        done = [r for c, r in results.items() if f"case_{m}__" in c]
        print(f"{m}: {sum(r.passed for r in done)} of {len(done)} exact "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    seconds = time.perf_counter() - t0
    cells: dict[tuple[str, str], str] = {}
    coverage: dict[tuple[str, str], str] = {}
    failures: list[str] = []
    for case, r in results.items():
        model, plan = case.split("::case_")[1].split("__")
        cells[(model, plan)] = "exact" if r.passed else "**fails**"
        if not r.passed:
            failures.append(f"- `{model}` under {PLAN_TEXT[plan]}: "
                            f"{_first_error(r.report)}")
        for line in r.output.splitlines():
            m = re.match(rf"coverage {model} {plan}: ([\d.]+) \((.*)\)", line)
            if m:
                coverage[(model, plan)] = f"{float(m.group(1)):.1%}"
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                         capture_output=True).stdout.strip()
    out = Path(args.out)
    old = out.read_text() if out.exists() else ""
    rows, failures = _merged(old, models, _rows(models, cells, coverage), failures)
    out.write_text(_page(rows, failures, seconds, rev, only=args.only or []) +
                   _kept_sections(old))
    print(f"wrote {args.out}: {sum(v == 'exact' for v in cells.values())} of {len(cells)} "
          f"exact in {seconds:.0f} s")
    return 0 if not failures else 1


def _kept_sections(page: str) -> str:
    """The sections of ``page`` this tool does not write (the losses table, volumes, torch's
    own bugs), to keep after the regenerated ones."""
    parts = page.split("\n## ")[1:]
    return "".join(f"\n## {p}" for p in parts if not p.startswith("Failures"))


def _merged(old: str, ran: list[str], rows: dict[str, str], failures: list[str]
            ) -> tuple[list[str], list[str]]:
    """The table rows of every model of ``MODELS`` (in its order) and the failure lines: those
    of the models just ``ran`` new, the others' as ``old`` (the page before) has them."""
    before = {m.group(1): line for line in old.splitlines()
              if (m := re.match(r"\| `(\w+)` \|", line))}
    kept = [line for line in old.split("\n## Failures\n")[-1].split("\n## ")[0].splitlines()
            if (m := re.match(r"- `(\w+)` under", line)) and m.group(1) not in ran] \
        if "\n## Failures\n" in old else []
    table = [rows[m] if m in rows else before[m] for m in MODELS if m in rows or m in before]
    return table, kept + failures


def _first_error(report: str) -> str:
    lines = [ln.strip() for ln in report.splitlines() if re.match(r"\s*\w+(Error|Exception)", ln)]
    return lines[-1][:300] if lines else report.strip().splitlines()[-1][:300]


def _rows(models: list[str], cells: dict, coverage: dict) -> dict[str, str]:
    rows = {}
    for m in models:
        size = "x".join(map(str, MODELS[m].size))
        cov = " / ".join(coverage.get((m, p), "-") for p in ("sp2", "sp4"))
        rows[m] = (f"| `{m}` | {size} | " + " | ".join(cells.get((m, p), "-") for p in PLANS) +
                   f" | {cov} |")
    return rows


def _page(rows: list[str], failures: list[str], seconds: float, rev: str, only: list[str]
          ) -> str:
    head = "| model | image | " + " | ".join(PLAN_TEXT[p] for p in PLANS) + \
        " | coverage SP2 / SP4 |"
    rule = "|" + "---|" * (len(PLANS) + 3)
    date = datetime.date.today().isoformat()
    which = (f"the rows of {', '.join(f'`{m}`' for m in only)} with `--only` on {date} at {rev} "
             f"({seconds / 60:.1f} min), the others by an earlier run of the whole matrix"
             if only else f"on {date} at {rev} ({seconds / 60:.1f} min)")
    return f"""# Models from the public libraries

Generated by `python tools/models_matrix.py`: {which} on this machine, one `mpiexec -n 4`
per model. Each cell trains the unchanged library model
compiled by fxpar and on one process in float64 and compares the loss, every gradient, the
parameters after 2 SGD steps with momentum and weight decay, every buffer (BatchNorm running
statistics and `num_batches_tracked`), `full_state_dict()` and the eval-mode output
(tolerance 1e-9 absolute, 1e-7 relative): **exact** means all of them matched. Models are
built with `num_classes=5` (segmentation: 3 classes), random weights, dropout and stochastic
depth off (random masks are outside the contract).

**Coverage** is the share of the spatial stages' forward FLOPs that runs on tiles, from
`fxpar-inspect` / `fxpar.passes.spatial_region.Coverage`: work every rank of the tile group
runs whole (squeeze-excite's 1x1 convolutions on pooled vectors, pyramid-pooling branches, the
classifier head) counts against it, so a rank runs about `(1 - coverage) + coverage / P` of
one process's forward FLOPs (`tests/mpi/test_coverage.py` checks it against torch's FLOP counter).
`fxpar.compile` warns below 90 % and `Plan(strict=True)` refuses it.

{head}
{rule}
{chr(10).join(rows)}

Library versions: {_versions()} (the test extras of `pyproject.toml`).
segmentation-models-pytorch models use a `resnet18` encoder and `encoder_weights=None`;
MONAI 2-D nets small channel counts; the exact builders are `MODELS` in
`tests/mpi/cases/library_cases.py`. `make test` runs every model under SP2 (but the three
`CI_NOT_SP2` names, whose blocks other CI cases train) and each other plan on one model;
`FXPAR_LIBRARY_MATRIX=1 make test` runs the whole matrix.

{"## Failures" + chr(10) + chr(10) + chr(10).join(failures) if failures else "Every cell passed."}
"""


def _versions() -> str:
    names = ("torch", "torchvision", "timm", "segmentation-models-pytorch", "monai")
    return ", ".join(f"{n} {importlib.metadata.version(n)}" for n in names)


if __name__ == "__main__":
    sys.exit(main())

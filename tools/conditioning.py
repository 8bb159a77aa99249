"""How far one process's own results move when the input moves by rounding: the floor under
which a compiled-vs-one-process difference is conditioning, not a bug.

Trains a library model (tests/mpi/cases/library_cases.py) on one process exactly as the
transparency check's reference does (float64, same seeds, the plan's micro-batches, 2 SGD steps
with momentum and weight decay, then the eval forward), twice: once on the input ``x`` and once
on ``x`` with every element moved by one unit in the last place (a random sign each), which is
the size of difference that summing in another order (per tile, per micro-batch) makes. Prints
the largest relative difference (max |a - b| / max |b| per tensor) of the loss, the gradients,
the parameters and the eval output between the two runs, and how many of the transparency
check's tolerances (atol 1e-8 + rtol 1e-7 |b|, eval rtol 1e-6) that is, and the same for two
runs on the very same input (which must be 0: the run is deterministic). Example::

    .venv/bin/python tools/conditioning.py tv_efficientnet_b0 sp2_pp

A compiled program whose difference from one process lies below the perturbed figure matches
one process as closely as one process matches itself on a rounding-different input.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "mpi")]

from cases.library_cases import MODELS, PLANS  # noqa: E402
from helpers.equivalence import ATOL64_LATER, RTOL64, RTOL64_EVAL, reference_step  # noqa: E402
from helpers.transparency import sgd  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the figure the failure lines of docs/models.md give."""
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / scale if scale else float((a - b).abs().max())


def _tols(a: torch.Tensor, b: torch.Tensor, rtol: float) -> float:
    """max |a - b| / (atol + rtol |b|): the transparency check's allowance used up (above 1,
    it would call the difference a failure)."""
    return float(((a - b).abs() / (ATOL64_LATER + rtol * b.abs())).max())


def train(model_key: str, plan_key: str, ulps: int, steps: int = 2) -> dict[str, torch.Tensor]:
    """One process's results after ``steps`` steps, the input moved by ``ulps`` ulps."""
    m, (plan, batch) = MODELS[model_key], PLANS[plan_key]
    torch.manual_seed(0)
    model = copy.deepcopy(m.build().double())
    g = torch.Generator().manual_seed(1)
    shape = (batch, 3, *m.size)
    x = torch.randn(shape, dtype=torch.float64, generator=g)
    classes = 3 if m.segmentation else 5
    y = torch.randint(0, classes, (batch, *m.size) if m.segmentation else (batch,), generator=g)
    if ulps:
        sign = torch.randint(0, 2, shape, generator=torch.Generator().manual_seed(2)) * 2 - 1
        x = x + sign * ulps * torch.finfo(torch.float64).eps * x.abs()
    opt = sgd(model.parameters())
    out: dict[str, torch.Tensor] = {}
    for step in range(steps):
        out[f"loss {step}"] = torch.tensor(reference_step(model, opt, x, y, plan.chunks()))
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[f"grad {name}"] = p.grad.detach().clone()
        out[name] = p.detach().clone()
    model.eval()
    with torch.no_grad():
        out["eval output"] = model(x)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("plan", choices=sorted(PLANS), help="its batch and micro-batches")
    ap.add_argument("--ulps", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    base = train(args.model, args.plan, 0)
    again = train(args.model, args.plan, 0)
    moved = train(args.model, args.plan, args.ulps)
    print(f"{args.model}, batch and micro-batches of {args.plan}, float64, one process: "
          f"max relative difference (max |a - b| / max |b|) between two runs")
    moved_by = f"input +-{args.ulps} ulp"
    print(f"{'':14} {'same input':>12} {moved_by:>14}   {moved_by} in tolerances of the "
          f"check (above 1: it fails)")
    groups = {"loss": [k for k in base if k.startswith("loss")],
              "gradients": [k for k in base if k.startswith("grad ")],
              "parameters": [k for k in base if not k.startswith(("loss", "grad ", "eval"))],
              "eval output": ["eval output"]}
    for label, keys in groups.items():
        same = max(_rel(again[k], base[k]) for k in keys)
        diff = max(_rel(moved[k], base[k]) for k in keys)
        rtol = max(RTOL64, RTOL64_EVAL) if label == "eval output" else RTOL64
        used = max(_tols(moved[k], base[k], rtol) for k in keys)
        print(f"{label:14} {same:12.2e} {diff:14.2e}   {used:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

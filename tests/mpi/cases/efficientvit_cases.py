"""timm's EfficientViT-B0 on tiles (run by tests/mpi/test_efficientvit.py) vs one process:
loss, every gradient, parameters after the SGD steps (momentum), every buffer
(tests/helpers/transparency.py), under SP2 and SP4, with at least 95 % of its work on tiles.

Its LiteMLA blocks run linear attention inside ``torch.autocast(enabled=False)`` (inlined at
capture, fxpar.frontend.hops): ``kv = k^T v`` contracts the tokens (each tile's partial
product, summed over the tiles), ``out = q @ kv`` and ``out[..., :-1] / (out[..., -1:] +
eps)`` act on each token. ``_attn`` casts q, k and v to float32 (``.float()``), so in a float64
model one process itself computes that block in float32, and the sum over tiles adds the
tokens' products in another order than one process's single product: those cases compare at
:data:`ATOL_F32` / :data:`RTOL_F32` after one step. The ``_float64_attention`` cases give each
LiteMLA an ``_attn`` without the casts: everything is float64, and two steps compare at the
usual exact tolerances (tests/helpers/equivalence.py), which shows that the rest of the model
is not loosened."""

from __future__ import annotations

from helpers.attention_models import efficientvit_b0
from helpers.transparency import Case, check

import fxpar
from fxpar.passes.spatial_region import Coverage

P = fxpar.Plan
PLANS = {"sp2": P(spatial_parts=2, slice="vertical"), "sp4": P(spatial_parts=4, slice="square")}
SIDE = 128
"""The image side: the classifier head (1024 -> 1280 -> 5 on the pooled vector, 2.6 MFLOPs an
image) runs whole on every rank and is 14 % of the work at 64 x 64, 4 % at 128 x 128."""

ATOL_F32 = 5e-5
RTOL_F32 = 1e-4
"""Element-wise tolerances of the cases whose attention computes in float32, as timm writes it
(the float64 cases keep tests/helpers/equivalence.py's). Measured on these cases' model, batch
and seeds: one process against itself, with only the float32 product ``k^T v`` summed over 2
or 4 parts of the tokens (what the tiles do), needs an ``atol`` of 3.7e-6 / 5.4e-6 (at rtol
1e-6) on the first step's gradients; the compiled programs need 5.5e-6 (SP2) / 6.9e-6 (SP4).
After a step, the BatchNorms over 4 x 4 maps amplify that rounding: one process against itself
needs 1.1e-4 on the second step's gradients, the compiled programs 1.1e-4 / 1.7e-4, so these
cases train :data:`F32_STEPS` step (the float64 ones two, exact). The float64 cases need at
most 5.5e-14 (at rtol 1e-7)."""
F32_STEPS = 1


def efficientvit_case(plan: str, float64_attention: bool) -> None:
    tol = {} if float64_attention else {"atol": ATOL_F32, "rtol": RTOL_F32}
    steps = 2 if float64_attention else F32_STEPS
    rp = check(Case(lambda: efficientvit_b0(float64_attention), (2, 3, SIDE, SIDE), PLANS[plan],
                    steps=steps), **tol)
    if rp is None:
        return
    cov = rp.program.traced.meta[Coverage.KEY]
    print(f"coverage efficientvit_b0 {plan}: {cov.share:.4f} ({cov.ended or 'whole model'})")
    assert cov.share >= 0.95, (plan, cov)


for _plan in PLANS:
    globals()[f"case_efficientvit_b0_{_plan}"] = (
        lambda p=_plan: efficientvit_case(p, float64_attention=False))
    globals()[f"case_efficientvit_b0_float64_attention_{_plan}"] = (
        lambda p=_plan: efficientvit_case(p, float64_attention=True))

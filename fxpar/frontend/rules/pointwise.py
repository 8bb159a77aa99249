"""The elementwise ATen ops: each output cell reads the same cell of each input (broadcasting
allowed), so on a tile each is the op on the tile's cells. One table for the model's spatial
region (fxpar.frontend.rules.aten_ops) and the loss (fxpar.frontend.rules.dims): adding an
elementwise op is one name here (and a test)."""

from __future__ import annotations

import torch

aten = torch.ops.aten

POINTWISE_NAMES = (
    # activations and their in-place forms
    "relu", "relu_", "relu6", "silu", "silu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "gelu",
    "gelu_", "hardswish", "hardswish_", "hardsigmoid", "hardsigmoid_", "hardtanh", "hardtanh_",
    "leaky_relu", "leaky_relu_", "elu", "elu_", "mish", "mish_", "softplus", "prelu", "selu",
    "selu_", "celu", "celu_", "log_sigmoid", "threshold", "threshold_", "logit",
    # arithmetic
    "add", "add_", "sub", "sub_", "rsub", "mul", "mul_", "div", "div_", "neg", "abs", "exp",
    "exp2", "expm1", "log", "log10", "log1p", "log2", "sqrt", "rsqrt", "square", "pow",
    "clamp", "clamp_", "clamp_min", "clamp_max", "reciprocal", "maximum", "minimum", "where",
    "addcdiv", "addcmul", "lerp", "fmod", "remainder", "xlogy", "sign", "heaviside",
    "floor", "ceil", "round", "trunc", "nan_to_num",
    # trigonometry and special functions (positional encodings, SIREN, exact GELU)
    "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "erf",
    "special_erf",
    # comparisons and logic
    "eq", "ne", "lt", "le", "gt", "ge", "isinf", "isnan", "logical_and", "logical_not",
    "logical_or", "logical_xor", "bitwise_and", "bitwise_not", "bitwise_or", "bitwise_xor",
    "masked_fill",
    # copies, casts and constants like the input
    "clone", "contiguous", "alias", "detach", "_to_copy", "to", "type_as", "copy",
    "lift_fresh_copy", "fill", "zeros_like", "ones_like", "full_like", "empty_like",
)
"""Elementwise ops, by ATen name (the ones this torch lacks are skipped)."""

POINTWISE = frozenset(getattr(aten, name) for name in POINTWISE_NAMES if hasattr(aten, name))
"""The overload packets of :data:`POINTWISE_NAMES`."""

"""CosmoFlow (Mathuriya et al. 2018, "CosmoFlow: Using Deep Learning to Learn the Universe at
Scale"; the MLPerf HPC CosmoFlow reference model): a 3-D CNN that regresses the cosmological
parameters of a simulated universe from its dark-matter density volume.

Why it is in the zoo: the inputs are large volumes (``4 x 128^3`` in MLPerf HPC, ``4 x 512^3`` at
full size) and all the work is in the early, full-resolution 3-D convolutions, which is the case
spatial parallelism is for; the dense head at the end is tiny and runs fine unsplit.

Layout for ``blocks = b``, ``base = c`` and a cubic input of side ``s``::

    block i = 0..b-1: Conv3d(3x3x3, padding 1) to min(c * 2**i, max_channels) channels,
                      LeakyReLU(0.3), 2x2x2 max pool (side s / 2**(i+1))
    head:             flatten (channels * (s / 2**b)**3 features),
                      Linear -> LeakyReLU(0.3) [-> Dropout], Linear -> LeakyReLU(0.3) [-> Dropout],
                      Linear to ``outputs`` (the 4 cosmological parameters)

The defaults (4 input channels, base 16, 5 blocks, side 128, hidden (128, 64), 4 outputs) are the
MLPerf HPC reference's: its channels are 16, 32, 64, 128, 256 and the flatten has 256 * 4**3 =
16384 features.  Differences from that reference: the convs here are 3x3x3 (the reference uses
2x2x2 kernels with "same" padding, which PyTorch has no symmetric equivalent for), and the output
is the raw linear regression (the reference squashes it with tanh and a learned scale); add those
in the loss if wanted.  Dropout modules exist only when ``dropout > 0``, so the default graph has
none.  The input must be ``(N, in_channels, input_size, input_size, input_size)``: the first
Linear's width is fixed by ``input_size``.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["CosmoFlow", "cosmoflow"]

#: Slope of the LeakyReLU activations (the reference's Keras default ``alpha=0.3``).
NEGATIVE_SLOPE = 0.3


class CosmoFlow(nn.Module):
    """Conv/LeakyReLU/max-pool blocks, then a three-layer dense regression head."""

    def __init__(
        self,
        in_channels: int = 4,
        base: int = 16,
        blocks: int = 5,
        input_size: int = 128,
        hidden: tuple[int, int] = (128, 64),
        outputs: int = 4,
        dropout: float = 0.0,
        max_channels: int = 512,
    ) -> None:
        super().__init__()
        _check(in_channels, base, blocks, input_size, hidden, outputs, dropout, max_channels)

        layers: list[nn.Module] = []
        channels = in_channels
        for i in range(blocks):
            width = min(base * 2**i, max_channels)
            layers += [
                nn.Conv3d(channels, width, 3, padding=1),
                nn.LeakyReLU(NEGATIVE_SLOPE, inplace=False),
                nn.MaxPool3d(2, stride=2),
            ]
            channels = width
        self.features = nn.Sequential(*layers)
        self.flatten = nn.Flatten(1)

        side = input_size // 2**blocks
        head: list[nn.Module] = []
        features = channels * side**3
        for width in hidden:
            head += [nn.Linear(features, width), nn.LeakyReLU(NEGATIVE_SLOPE, inplace=False)]
            if dropout > 0:
                head.append(nn.Dropout(dropout))
            features = width
        head.append(nn.Linear(features, outputs))
        self.head = nn.Sequential(*head)

    def forward(self, x: Tensor) -> Tensor:
        """Volumes ``(N, in_channels, s, s, s)``, ``s = input_size`` -> ``(N, outputs)``."""
        return self.head(self.flatten(self.features(x)))


def _check(
    in_channels: int,
    base: int,
    blocks: int,
    input_size: int,
    hidden: tuple[int, int],
    outputs: int,
    dropout: float,
    max_channels: int,
) -> None:
    """Raise ``ValueError`` saying what to change for a configuration that cannot be built."""
    if blocks < 1:
        raise ValueError(f"cosmoflow: blocks must be >= 1, got {blocks}")
    for name, value in [("in_channels", in_channels), ("base", base), ("outputs", outputs),
                        ("max_channels", max_channels), ("input_size", input_size)]:
        if value < 1:
            raise ValueError(f"cosmoflow: {name} must be >= 1, got {value}")
    if len(hidden) != 2 or min(hidden) < 1:
        raise ValueError(f"cosmoflow: hidden must be two positive widths, got {hidden!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"cosmoflow: dropout must be in [0, 1), got {dropout}")
    factor = 2**blocks
    if input_size % factor:
        fits = (input_size & -input_size).bit_length() - 1  # the power of 2 in input_size
        lower = input_size // factor * factor
        sizes = f"{lower} or {lower + factor}" if lower else f"{factor}"
        fewer = f", or blocks <= {fits} for input_size {input_size}" if fits else ""
        raise ValueError(
            f"cosmoflow: input_size {input_size} is not divisible by 2**blocks = {factor} "
            f"(each of the {blocks} blocks halves the side with a 2x2x2 max pool); use an "
            f"input_size that is a multiple of {factor} (e.g. {sizes}){fewer}"
        )


def cosmoflow(
    in_channels: int = 4,
    base: int = 16,
    blocks: int = 5,
    input_size: int = 128,
    hidden: tuple[int, int] = (128, 64),
    outputs: int = 4,
    dropout: float = 0.0,
    max_channels: int = 512,
    num_classes: int | None = None,
) -> nn.Module:
    """Build a CosmoFlow regression CNN for cubic inputs of side ``input_size``.

    Block ``i`` has ``min(base * 2**i, max_channels)`` channels; ``input_size`` must be divisible
    by ``2**blocks`` (ValueError otherwise, saying what to change).  ``hidden`` are the widths of
    the two hidden dense layers, ``outputs`` the number of regressed parameters (4 in the paper:
    Omega_m, sigma_8, N_s, H_0), ``dropout`` the rate after each hidden layer (0: no Dropout).
    The defaults are the MLPerf HPC reference sizes (about 3.3M parameters). ``num_classes``,
    when given, is ``outputs`` under the name the command-line tools pass (``fxpar-run
    --num-classes``).
    """
    outputs = outputs if num_classes is None else num_classes
    return CosmoFlow(in_channels, base, blocks, input_size, hidden, outputs, dropout, max_channels)

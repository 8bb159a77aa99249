"""MONAI's SwinUNETR (2-D) with shifted windows of 4, for ``fxpar-inspect`` and ``fxpar-run``:

    fxpar-inspect examples/swin_unetr.py:swin_unetr --image-size 512 --channels 1 \\
        --spatial-parts 4 --slice square

(docs/attention.md shows its output)."""

from torch import nn


def swin_unetr() -> nn.Module:
    import monai.networks.nets as mn

    return mn.SwinUNETR(in_channels=1, out_channels=3, feature_size=24, spatial_dims=2,
                        window_size=4)

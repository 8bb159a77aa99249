"""A model that returns a structure (smp's U-Net with a class head: ``(mask, label)``) and the
loss written for it, on 4 tiles: the mask leaves the tiles tiled, the label whole on every
rank; the loss takes the structure, its Dice and cross-entropy sums run over the tiles.

    mpiexec -n 4 python examples/aux_heads.py     # SP4, a 2x2 grid of tiles
    python examples/aux_heads.py                  # one process: the same losses
"""

import segmentation_models_pytorch as smp
import torch
import torch.nn.functional as F

import fxpar
from fxpar.comm.world import world

torch.manual_seed(0)  # every rank builds the same initial weights
model = smp.Unet("resnet18", encoder_weights=None, encoder_depth=3, decoder_channels=(16, 8, 8),
                 classes=3, aux_params={"classes": 2})  # returns (mask, label)
dice = smp.losses.DiceLoss("multiclass")


def loss(out: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
         label: torch.Tensor) -> torch.Tensor:  # the loss, over the structure
    seg, cls = out
    return dice(seg, mask) + F.cross_entropy(seg, mask) + 0.4 * F.cross_entropy(cls, label)


g = torch.Generator().manual_seed(1)
x = torch.randn(4, 3, 64, 64, generator=g)
mask, label = torch.randint(0, 3, (4, 64, 64), generator=g), torch.randint(0, 2, (4,), generator=g)
plan = fxpar.Plan(spatial_parts=world().size, slice="square")
program = fxpar.compile(model, plan, x, loss_fn=loss, target=(mask, label),
                        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
with program.local() as rp:
    for step in range(3):
        value = rp.train_step(x, (mask, label))
        if rp.rank == 0:
            print(f"step {step}: loss {value:.6f}")
    rp.eval()
    seg, cls = rp.forward(x)  # the model's structure, on every rank of the last stage
    if rp.rank == 0:
        leaves = program.spatial.leaf_extents if program.spatial else (None, None)
        print(f"{program.world_size} rank(s); forward: {type(seg).__name__} {tuple(seg.shape)},"
              f" {tuple(cls.shape)}; leaves on the tiles: "
              f"{['tiled {}x{}'.format(*e) if e else 'whole' for e in leaves]}")

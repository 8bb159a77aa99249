"""Train and validate a timm model under SP2 + PP2 with fxpar.Trainer (3 ranks: stage 0 on two
tiles, stage 1 on a third):  mpiexec -n 3 python examples/train_timm.py"""

import timm
import torch
import torch.nn.functional as F

import fxpar
from fxpar.data.data import Synthetic
from fxpar.train.evaluate import Validation

shape = (4, 3, 128, 128)  # the global batch
torch.manual_seed(0)  # every rank builds the same initial weights
model = timm.create_model("resnet18", num_classes=5)
plan = fxpar.Plan(spatial_parts=2, stages=2, microbatches=2)
program = fxpar.compile(model, plan, shape, loss_fn=F.cross_entropy,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))
data = Synthetic(shape, classes=5)  # a fixed random batch; fxpar.data.samples reads real ones
val = Validation(Synthetic((1, *shape[1:]), classes=5, seed=1), samples=8, task="classify",
                 classes=5, shape=shape, dtype=torch.float32)
with program.local() as rp:  # this rank's program; each reads only its window of the images
    window = rp.input_window()
    config = fxpar.TrainConfig(steps=6, eval_every=3, log_every=1)
    fxpar.Trainer(rp, config, lambda step: data.batch(step, window), val=val).fit()

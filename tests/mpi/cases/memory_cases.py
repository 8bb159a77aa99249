"""Bytes saved for backward per rank (saved-tensor hooks), SP with P=4 vs one process."""

import torch
import torchvision.models as tvm
from helpers.transparency import sub_comm
from torch import nn

import fxpar


class SavedBytes:
    """Counts the distinct storages autograd saves for backward, parameters excluded."""

    def __init__(self, model: nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in self.params:
            self.seen[s.data_ptr()] = s.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def _measure(step, model) -> int:
    counter = SavedBytes(model)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        step()
    return counter.total


def case_resnet50_512_p4_saves_at_most_030():
    comm = sub_comm(4)
    if comm is None:
        return
    torch.manual_seed(0)
    model = tvm.resnet50(num_classes=10)
    x = torch.randn(1, 3, 512, 512)
    y = torch.tensor([3])
    program = fxpar.compile(model, fxpar.Plan(spatial_parts=4), x.shape)
    rp = program.local(comm)
    mine = _measure(lambda: rp.train_step(x, y), model)
    ranks = comm.allgather_object(mine)
    if comm.rank == 0:
        single = _measure(lambda: nn.functional.cross_entropy(model(x), y).backward(), model)
        ratios = [r / single for r in ranks]
        print(f"saved-for-backward bytes: single {single / 2**20:.1f} MiB; per rank "
              f"{[round(r / 2**20, 1) for r in ranks]} MiB; ratios "
              f"{[round(r, 3) for r in ratios]}", flush=True)
        assert max(ratios) <= 0.30, ratios
        assert min(ratios) >= 0.2, ratios  # each tile really holds its quarter

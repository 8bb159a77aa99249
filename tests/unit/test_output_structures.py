"""Model outputs that are structures (fxpar.core.outputs, fxpar.compiler.outputs) in one
process: capture of dicts, NamedTuples, nested lists and dataclasses (no registration by the
user), training and forward on the structure, a saved program rebuilding it, leaf names and
keys, and what a plan refuses at compile time (the MPI cases: tests/mpi/test_outputs.py)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import NamedTuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

import fxpar
from fxpar.compiler.outputs import OutputWarning
from fxpar.core.outputs import leaf_names, out_spec_json, out_spec_of, pick, plain


@dataclasses.dataclass
class Out:
    mask: torch.Tensor
    extra: torch.Tensor | None = None


class Pair(NamedTuple):
    mask: torch.Tensor
    label: torch.Tensor


class Net(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.mask, self.aux, self.fc = nn.Conv2d(4, 2, 1), nn.Conv2d(4, 2, 1), nn.Linear(4, 3)

    def forward(self, x):
        f = self.body(x)
        mask, label = self.mask(f), self.fc(f.mean((2, 3)))
        if self.form == "dataclass":
            return Out(mask)
        if self.form == "namedtuple":
            return Pair(mask, label)
        if self.form == "constant":
            return {"out": mask, "classes": 2}
        if self.form == "scalar":
            return mask, (mask * mask).mean()
        return {"out": mask, "heads": [self.aux(f), label]}


def loss(o, y):
    if isinstance(o, Out):
        return F.cross_entropy(o.mask, y)
    if isinstance(o, Pair):
        return F.cross_entropy(o.mask, y) + o.label.square().mean()
    if isinstance(o, tuple):
        return F.cross_entropy(o[0], y) + o[1]
    return F.cross_entropy(o["out"], y) + 0.5 * F.cross_entropy(o["heads"][0], y) + \
        o["heads"][1].square().mean()


X = torch.randn(4, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, 2, (4, 8, 8), generator=torch.Generator().manual_seed(1))


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3)


@pytest.mark.parametrize("form", ["dict", "dataclass", "namedtuple", "scalar"])
@pytest.mark.parametrize("microbatches", [1, 2])
def test_one_rank_trains_and_returns_the_structure(form, microbatches):
    torch.manual_seed(0)
    model = Net(form).double()
    ref = copy.deepcopy(model)
    plan = fxpar.Plan(microbatches=microbatches)
    with pytest.warns(OutputWarning) if form == "scalar" and microbatches > 1 else \
            contextlib.nullcontext():
        program = fxpar.compile(model, plan, X, loss_fn=loss, optimizer=_sgd)
    rp = program.local()
    opt = _sgd(ref.parameters())
    for _ in range(2):
        got = rp.train_step(X, Y)
        opt.zero_grad()
        want = 0.0
        for x, y in zip(X.chunk(microbatches), Y.chunk(microbatches), strict=True):
            part = loss(ref(x), y) / microbatches
            part.backward()
            want += float(part)
        opt.step()
        assert abs(got - want) < 1e-12
    for (name, p), (_, q) in zip(rp.named_parameters(), ref.named_parameters(), strict=True):
        assert (p - q).abs().max() < 1e-12, name
    # a head the loss never reads keeps no gradient (weight decay leaves it alone)
    if form in ("dataclass", "scalar"):
        assert dict(rp.named_parameters())["fc.weight"].grad is None
    rp.eval()
    ref.eval()
    out, want = rp.forward(X), ref(X)
    if form == "scalar" and microbatches > 1:  # one per chunk, stacked
        assert out[1].shape == (microbatches,)
        return
    got_leaves, got_spec = pytree.tree_flatten(out)
    want_leaves, want_spec = pytree.tree_flatten(want)
    assert got_spec == want_spec and type(out) is type(want)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert (g - w).abs().max() < 1e-12


def test_leaf_names_keys_and_the_saved_form():
    torch.manual_seed(0)
    program = fxpar.compile(Net("dict").double(), fxpar.Plan(), X, loss_fn=loss)
    spec = program.graph.out_spec
    assert leaf_names(spec) == ["['out']", "['heads'][0]", "['heads'][1]"]
    assert pick(spec, "out") == 0 and pick(spec, "['heads'][1]") == 2
    with pytest.raises(ValueError, match=r"no leaf 'aux': its leaves are \['out'\]"):
        pick(spec, "aux")
    dc = pytree.tree_structure(Out(torch.zeros(1), torch.zeros(1)))
    assert out_spec_of(out_spec_json(dc)) == plain(dc)  # a dataclass is kept as a dict
    assert pytree.tree_unflatten([1, 2], plain(dc)) == {"mask": 1, "extra": 2}


def test_a_saved_program_rebuilds_the_structure(tmp_path):
    torch.manual_seed(0)
    model = Net("dict").double().eval()
    program = fxpar.compile(model, fxpar.Plan(), X, loss_fn=loss)
    program.save(tmp_path / "job")
    rp = fxpar.load_program(tmp_path / "job", loss_fn=loss)
    rp.eval()
    out, want = rp.forward(X), model(X)
    assert list(out) == ["out", "heads"] and len(out["heads"]) == 2
    assert (out["heads"][0] - want["heads"][0]).abs().max() < 1e-12


def test_a_constant_leaf_cannot_go_into_a_loss_on_tiles():
    model = Net("constant").double()
    with pytest.raises(fxpar.PlanError, match=r"leaf \['classes'\] is 2 \(int\), not a tensor"):
        fxpar.compile(model, fxpar.Plan(spatial_parts=2), X,
                      loss_fn=lambda o, y: F.cross_entropy(o["out"], y))
    # where the loss sees the whole output, the constant is passed as it is
    program = fxpar.compile(model, fxpar.Plan(), X,
                            loss_fn=lambda o, y: F.cross_entropy(o["out"], y) * o["classes"])
    rp = program.local()
    assert rp.train_step(X, Y) > 0 and rp.forward(X)["classes"] == 2


def test_predict_writes_the_leaf_output_key_names():
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4),
                                      nn.ReLU())
            self.o, self.a = nn.Conv2d(4, 2, 1), nn.Conv2d(4, 3, 3, padding=1)

        def forward(self, x):
            f = self.body(x)
            return {"out": self.o(f), "aux": self.a(f)}

    torch.manual_seed(0)
    model = Two().double().eval()
    image = torch.randn(3, 20, 18, dtype=torch.float64)
    kw = dict(region=8, output="logits", dtype=torch.float64, progress=False)
    with pytest.raises(fxpar.PlanError, match=r"returns 2 tensors .*\['out'\], \['aux'\].*"
                       r"--output-key"):
        fxpar.predict(model, fxpar.Plan(), image.numpy(), **kw)
    for key, name in (("out", "out"), ("['aux']", "aux")):
        got = fxpar.predict(model, fxpar.Plan(), image.numpy(), output_key=key, **kw).output
        want = model(image[None])[name][0].detach().numpy()
        assert np.abs(got - want).max() < 1e-12
    assert not model.training  # the model's mode is left as it was

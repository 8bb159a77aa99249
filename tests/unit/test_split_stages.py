"""The stage cutter and stage graphs, without MPI: run the stages one after another in one
process, following the transfers, and compare with the model."""

import pytest
import torch
import torchvision
from torch import nn

from fxpar import models
from fxpar.compiler.passdriver import run_passes
from fxpar.compiler.stages import build_stages
from fxpar.core.plan import Plan, PlanError
from fxpar.core.stages import StageGraph
from fxpar.frontend.trace import trace
from fxpar.passes.split_stages import compute_nodes, cut_traffic, split_stages


def staged(model, shape, **plan):
    gm = trace(model, shape)
    return build_stages(run_passes(gm, Plan(**plan), [("split_stages", split_stages)]))


def run_in_sequence(graph: StageGraph, x):
    """Execute the stages in order in one process, carrying each transfer."""
    outputs = {}
    for k, module in enumerate(graph.modules):
        ins = []
        for src in graph.inputs[k]:
            if src.source == "batch":
                ins.append(x)
            else:
                t = graph.transfers[src.index]
                ins.append(outputs[t.src][t.src_out])
        outputs[k] = module(*ins)
        assert len(outputs[k]) == graph.n_outputs[k]
    return outputs[len(graph.modules) - 1][0]


@pytest.mark.parametrize("name, stages", [("resnet18", 3), ("densenet121", 4),
                                          ("googlenet", 3), ("mobilenet_v3_small", 5)])
def test_stages_in_sequence_equal_the_model(name, stages):
    torch.manual_seed(0)
    kw = dict(aux_logits=False, init_weights=False) if name == "googlenet" else {}
    model = torchvision.models.get_model(name, num_classes=4, **kw).eval()
    x = torch.randn(2, 3, 64, 64)
    graph = staged(model, x.shape, stages=stages)
    assert len(graph.modules) == stages
    assert torch.equal(run_in_sequence(graph, x), model(x))
    names = [n for m in graph.modules for n, _ in m.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())


def test_unet_skips_go_straight_to_the_stage_that_uses_them():
    model = models.build("unet", num_classes=2, base_channels=4, depth=3).eval()
    x = torch.randn(1, 3, 16, 16)
    graph = staged(model, x.shape, stages=4)
    spans = sorted({t.dst - t.src for t in graph.transfers})
    assert spans[-1] >= 2, spans  # a skip crosses at least two cuts, sent once, directly
    assert torch.allclose(run_in_sequence(graph, x), model(x))


class EarlyOutput(nn.Module):
    """Returns a value computed in the first stage next to the final one."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.c = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        early = self.a(x)
        return self.c(self.b(early)), early.mean()


def test_output_built_from_several_stages_and_model_input_used_late():
    model = EarlyOutput()
    x = torch.randn(2, 3, 8, 8)
    graph = staged(model, x.shape, stages=3)
    got, want = run_in_sequence(graph, x), model(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_explicit_balance_is_followed():
    model = torchvision.models.resnet18()
    graph = staged(model, (2, 3, 32, 32), stages=3, balance=(10, 20, 39))
    counts = [len([n for n in m.graph.nodes if n.op not in ("placeholder", "output",
                                                            "get_attr")])
              for m in graph.modules]
    assert counts[:2] == [10, 20]  # the last stage also holds the output marker


def test_balance_that_does_not_sum_says_the_node_count():
    with pytest.raises(PlanError, match=r"sums to 30 but the model has 69 compute nodes.*"
                       r"make it sum to 69"):
        staged(torchvision.models.resnet18(), (2, 3, 32, 32), stages=2, balance=(10, 20))


def test_more_stages_than_nodes():
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.ReLU())
    with pytest.raises(PlanError, match="Plan.stages=3 but the model has only 2 compute nodes"):
        staged(model, (1, 3, 4, 4), stages=3)


def test_shared_module_across_stages_is_refused():
    conv = nn.Conv2d(3, 3, 3, padding=1)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = conv
            self.mid = nn.Sequential(*[nn.Conv2d(3, 3, 1) for _ in range(6)])

        def forward(self, x):
            return self.conv(self.mid(self.conv(x)))

    with pytest.raises(PlanError, match=r"parameter conv.weight is used in stages \[0, 1\]"):
        staged(Twice(), (1, 3, 8, 8), stages=2)


def test_cut_prefers_small_traffic_within_the_balance_tolerance():
    # equal-cost convs; the 1-channel bottleneck after conv 3 is the cheap place to cut
    layers = [nn.Conv2d(16, 16, 3, padding=1) for _ in range(3)] + \
        [nn.Conv2d(16, 1, 3, padding=1), nn.Conv2d(1, 16, 3, padding=1)] + \
        [nn.Conv2d(16, 16, 3, padding=1) for _ in range(3)]
    model = nn.Sequential(*layers)
    gm = trace(model, (1, 16, 32, 32))
    order = compute_nodes(gm)
    traffic = cut_traffic(gm, order)
    assert traffic[4] == 32 * 32 * 4  # only the 1-channel tensor crosses before node 4
    graph = staged(model, (1, 16, 32, 32), stages=2)
    (t,) = graph.transfers
    assert t.shape == (1, 1, 32, 32)

"""program.save writes plain files that import and rebuild each rank's stages exactly (no MPI:
the MPI half, training a saved program under mpiexec, is in cases/emit_cases.py)."""

import importlib.util
import json
import re
import shutil
import sys

import pytest
import torch
import torchvision.models as tvm

import fxpar
from fxpar.core.schedule import Action
from fxpar.program.emit import rank_sources, save
from fxpar.program.loader import load

SHAPE = (4, 3, 32, 32)


def _compile(model, plan, shape=SHAPE, **kw):
    return fxpar.compile(model, plan, torch.empty(shape, dtype=torch.float64, device="meta"),
                         **kw)


def _import(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = tvm.resnet18(num_classes=5).double()
    plan = fxpar.Plan(stages=2, spatial_parts=2, spatial_stages=1, microbatches=2)
    program = _compile(model, plan)
    root = tmp_path_factory.mktemp("job")
    program.save(root / "job")
    moved = root / "moved"
    shutil.move(root / "job", moved)  # nothing in the files points at where they were written
    return program, moved


def test_layout_and_json(saved):
    program, root = saved
    info = json.loads((root / "program.json").read_text())
    assert info["world_size"] == 3 and info["batch_size"] == 4
    assert info["plan"]["spatial_parts"] == 2 and info["loss_fn"].endswith("cross_entropy")
    assert [r["roles"] for r in info["ranks"]] == [
        [{"copy": 0, "stage": 0, "tile": 0}], [{"copy": 0, "stage": 0, "tile": 1}],
        [{"copy": 0, "stage": 1, "tile": 0}]]
    assert len(info["transfers"]) == len(program.graph.transfers)
    for r in range(3):
        rank = json.loads((root / f"rank{r:05d}" / "rank.json").read_text())
        assert rank["rank"] == r and rank["plan"] == info["plan"]
        text = (root / f"rank{r:05d}" / "actions.txt").read_text().splitlines()
        acts = [Action.from_str(line) for line in text if not line.startswith("#")]
        assert acts == program.schedule[r]


def test_generated_code_is_readable_python(saved):
    _, root = saved
    code = (root / "rank00001" / "c0_s0" / "module.py").read_text()
    assert "class Stage0Tile1(torch.nn.Module):" in code
    assert "from fxpar.runtime.spatial.ops import HaloOp" in code
    assert "put(self, 'layer1.0.bn1.running_mean', torch.empty((64,), dtype=torch.float64))" \
        in code
    assert "def forward(self, x" in code and "TileBatchNorm" in code
    assert re.search(r"fxpar_halo_\d+ = self\.fxpar_halo_\d+\(.*  # layer1\.0\.conv1\n", code)
    assert str(root) not in code and "torch.load(_HERE / 'weights.pt'" not in code
    assert "pickled" not in code  # every module of resnet18 is written as a constructor call
    compile(code, "module.py", "exec")


def test_each_stage_rebuilds_exactly(saved):
    program, root = saved
    for r in range(3):
        for (c, s), ref in program.stage_modules(r).items():
            mod = _import(root / f"rank{r:05d}" / f"c{c}_s{s}" / "module.py", f"t_{r}_{c}_{s}")
            stage = mod.load()
            got, want = stage.state_dict(), ref.state_dict()
            assert set(got) == set(want)
            for k, v in got.items():
                assert v.dtype == want[k].dtype and torch.equal(v, want[k]), k
            assert all(torch.equal(p, ref.get_parameter(n)) for n, p in stage.named_parameters())
    # a stage without spatial ops runs alone: same output as the compiled module, bit for bit
    last = _import(root / "rank00002" / "c0_s1" / "module.py", "t_last").load()
    ref = program.graph.modules[1]
    ins = [torch.randn(t.shape, dtype=t.dtype) for t in program.graph.recvs(1)]
    torch.testing.assert_close(last(*ins), ref(*ins), rtol=0, atol=0)


def test_rank_sources_match_the_files(saved):
    program, root = saved
    files = rank_sources(program, 1)
    assert set(files) == {"c0_s0/module.py", "actions.txt"}
    assert files["c0_s0/module.py"] == (root / "rank00001/c0_s0/module.py").read_text()


def test_wrong_world_size_is_a_clear_error(saved):
    _, root = saved

    class FakeComm:
        size, rank = 4, 0

    with pytest.raises(fxpar.PlanError, match="compiled for 3 ranks but the job has 4: run it "
                       "with `mpiexec -n 3`"):
        load(root, FakeComm())
    with pytest.raises(fxpar.PlanError, match="not a saved fxpar program"):
        load(root / "rank00000")


def test_meta_built_model_saves_real_weights(tmp_path):
    """A model built on meta is materialised rank by rank while saving: the files hold the
    values fxpar.runtime.materialize gives the whole model on one process."""
    from fxpar.runtime.materialize import materialize_model

    with torch.device("meta"):
        model = tvm.resnet18(num_classes=5).double()
        whole = tvm.resnet18(num_classes=5).double()
    program = _compile(model, fxpar.Plan(stages=2))
    save(program, tmp_path)
    want = materialize_model(whole).state_dict()
    for r in range(2):
        got = load(tmp_path, rank=r).state_dict()
        assert got and all(torch.equal(v, want[k]) for k, v in got.items())

"""Validation (fxpar.train.evaluate, fxpar-run --val-data): the metric sums against a direct
one-process computation in float64, the padding of the last batch, which rank scores which
rows, the flags' errors; and, under one mpiexec launch of 4 ranks, compiled plans' eval passes
and fxpar-run's against one process (tests/mpi/cases/eval_cases.py)."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.launch import Batch, cases_in, check

import fxpar
from fxpar.cli import run
from fxpar.testing import load_case
from fxpar.train import evaluate as ev
from fxpar.train.evaluate import Validation, contributed_rows, summarize, sums
from fxpar.train.metrics import MetricsError, load_metrics

CASES_FILE = Path(__file__).parent / "cases" / "eval_cases.py"
CASES, NAMES = cases_in("eval_cases.py")
tiny_net = load_case(f"{CASES_FILE}::tiny_net")
write_val = load_case(f"{CASES_FILE}::write_val")
folder_set = load_case(f"{CASES_FILE}::folder_set")
reference = load_case(f"{CASES_FILE}::reference")
assert_metrics = load_case(f"{CASES_FILE}::assert_metrics")
Tensors = load_case(f"{CASES_FILE}::Tensors")


# -- the sums -----------------------------------------------------------------------------------
def _logits(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def test_classification_sums_equal_a_direct_computation_and_padding_is_left_out():
    out, y = _logits(10, 4), torch.randint(0, 4, (10,), generator=torch.Generator().manual_seed(1))
    valid = 7  # rows 7.. are padding: never scored
    v = sums(out[:valid], y[:valid], F.cross_entropy, "classify", 4)
    m = summarize(v, "classify", 4)
    pred = out[:valid].argmax(1)
    assert m["samples"] == 7 and m["correct"] == int((pred == y[:valid]).sum())
    assert m["loss"] == pytest.approx(float(F.cross_entropy(out[:valid], y[:valid])), abs=1e-14)
    assert m["accuracy"] == m["correct"] / 7
    # rows in any parts, summed, are the whole: counts exactly, the loss to rounding
    parts = sum(sums(out[a:b], y[a:b], F.cross_entropy, "classify", 4)
                for a, b in ((0, 3), (3, 4), (4, 7), (7, 7)))
    assert torch.equal(parts[1:], v[1:]) and float(parts[0]) == pytest.approx(float(v[0]),
                                                                              rel=1e-14)


def test_segmentation_sums_give_dice_iou_and_pixel_accuracy_per_class():
    out = _logits(3, 4, 5, 6, seed=2)
    y = torch.randint(0, 3, (3, 5, 6), generator=torch.Generator().manual_seed(3))  # no class 3
    out[:, 3] -= 100.0  # class 3 is never predicted: absent from both, undefined
    m = summarize(sums(out, y, F.cross_entropy, "segment", 4), "segment", 4)
    pred = out.argmax(1)
    assert m["loss"] == pytest.approx(float(F.cross_entropy(out, y)), abs=1e-14)  # per pixel
    assert m["pixels"] == 90 and m["samples"] == 3
    assert m["accuracy"] == float((pred == y).double().mean())
    dice, iou = [], []
    for c in range(3):
        p, t = pred == c, y == c
        dice.append(2 * float((p & t).sum()) / float(p.sum() + t.sum()))
        iou.append(float((p & t).sum()) / float((p | t).sum()))
        assert m["per_class"][c]["dice"] == pytest.approx(dice[-1], abs=1e-15)
        assert m["per_class"][c]["iou"] == pytest.approx(iou[-1], abs=1e-15)
        assert m["per_class"][c]["pixels"] == int(t.sum())
    assert m["per_class"][3] == {"class": 3, "dice": None, "iou": None, "pixels": 0,
                                 "predicted": 0}
    assert m["dice"] == pytest.approx(sum(dice) / 3) and m["iou"] == pytest.approx(sum(iou) / 3)


@pytest.mark.parametrize("y, message", [
    (torch.tensor([0, 5]), "hold class 5 but the model has 4 classes"),
    (torch.tensor([0, -1]), "hold class -1"),
    (torch.zeros(2, 3, dtype=torch.int64), "do not fit the model output"),
])
def test_targets_that_do_not_fit_the_output_are_a_clear_error(y, message):
    with pytest.raises(ev.DataError, match=message):
        sums(_logits(2, 4), y, F.cross_entropy, "classify", 4)


# -- who scores which rows ----------------------------------------------------------------------
@pytest.mark.parametrize("plan", [
    fxpar.Plan(), fxpar.Plan(stages=2, spatial_parts=2, microbatches=2),
    fxpar.Plan(data_parallel=2, spatial_parts=2), fxpar.Plan(stages=2, gems=True),
    fxpar.Plan(stages=3, gems=True, data_parallel=2), fxpar.Plan(stages=2, gems=True,
                                                                 gems_times=2),
], ids=["one rank", "SP2+PP2", "SP2+DP2", "GEMS", "GEMS+DP2", "GEMS x2 rounds"])
def test_each_row_is_scored_by_exactly_one_rank_that_holds_the_last_stage(plan):
    program = fxpar.compile(tiny_net(), plan, torch.empty((8, 3, 16, 16), device="meta"))
    rows = []
    for r in range(program.world_size):
        mine = contributed_rows(program, r, 8)
        if mine:
            assert any(role.stage == plan.stages - 1 for role in
                       program.rank_map.roles_of(r)), (r, mine)
        rows += [i for a, b in mine for i in range(a, b)]
    assert sorted(rows) == list(range(8))


# -- a whole pass in one process ----------------------------------------------------------------
def _val(root: Path, n: int, batch: int, limit: int | None = None) -> Validation:
    write_val(root, n=n)
    return ev.open_validation(root, (batch, 3, 16, 16), torch.float64, 3, limit=limit)


def test_a_pass_pads_the_last_batch_and_equals_one_process(tmp_path):
    torch.manual_seed(0)
    model = tiny_net().double()
    rp = fxpar.compile(model, fxpar.Plan(microbatches=2),
                       torch.empty((4, 3, 16, 16), dtype=torch.float64, device="meta")).local()
    val = _val(tmp_path, 7, 4)
    assert (val.samples, val.batches, val.used, val.task) == (7, 2, 7, "classify")
    got = ev.evaluate(rp, val, rp.input_window())
    assert all(m.training for m in rp.stages.values())  # back in training mode
    x, y = folder_set(tmp_path, 7)
    assert_metrics(got, reference(model, x, y), "one process")
    capped = ev.evaluate(rp, Validation(**{**vars(val), "limit": 1}), rp.input_window())
    assert capped["samples"] == 4
    assert_metrics(capped, reference(model, x[:4], y[:4]), "--val-batches 1")


def test_the_comparison_catches_an_off_by_one_in_the_padding_mask(tmp_path, monkeypatch):
    """The harness check: scoring one padding row too many (a repeated sample) moves the counts
    and the loss, and assert_metrics (what the MPI cases use) says so."""
    torch.manual_seed(0)
    model = tiny_net().double()
    rp = fxpar.compile(model, fxpar.Plan(),
                       torch.empty((4, 3, 16, 16), dtype=torch.float64, device="meta")).local()
    val = _val(tmp_path, 5, 4)
    x, y = folder_set(tmp_path, 5)
    want = reference(model, x, y)
    read = ev.read_batch
    monkeypatch.setattr(ev, "read_batch", lambda *a: (lambda t: (t[0], t[1], t[2] + 1))(read(*a)))
    with pytest.raises(AssertionError, match="samples 6 != 5"):
        assert_metrics(ev.evaluate(rp, val, rp.input_window()), want, "off by one")


def test_a_segmentation_pass_in_one_process_reads_masks_whole(tmp_path):
    seg = load_case(f"{CASES_FILE}::tiny_segmenter")
    torch.manual_seed(0)
    model = seg().double()
    rp = fxpar.compile(model, fxpar.Plan(),
                       torch.empty((2, 3, 16, 16), dtype=torch.float64, device="meta")).local()
    g = torch.Generator().manual_seed(1)
    x = torch.randn((3, 3, 16, 16), dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (3, 16, 16), generator=g)
    val = Validation(Tensors(x, y), 3, "segment", 3, (2, 3, 16, 16), torch.float64)
    ev.check_output(val, ev.output_shape(rp.program))
    assert_metrics(ev.evaluate(rp, val, rp.input_window()), reference(model, x, y), "segment")


@pytest.mark.parametrize("masks", [False, True], ids=["labels", "masks"])
def test_a_pass_over_a_csv_of_labels_or_masks_equals_one_process(tmp_path, masks):
    write_csv, csv_set = (load_case(f"{CASES_FILE}::{n}") for n in ("write_csv", "csv_set"))
    build = load_case(f"{CASES_FILE}::{'tiny_segmenter' if masks else 'tiny_net'}")
    torch.manual_seed(0)
    model = build().double()
    rp = fxpar.compile(model, fxpar.Plan(),
                       torch.empty((2, 3, 16, 16), dtype=torch.float64, device="meta")).local()
    csv = write_csv(tmp_path, 5, masks=masks)
    val = ev.open_validation(csv, (2, 3, 16, 16), torch.float64, 3)
    assert (val.task, val.samples, val.batches) == ("segment" if masks else "classify", 5, 3)
    ev.check_output(val, ev.output_shape(rp.program))
    x, y = csv_set(csv, 5)
    assert_metrics(ev.evaluate(rp, val, rp.input_window()), reference(model, x, y), "CSV")


# -- fxpar-run's flags --------------------------------------------------------------------------
@pytest.mark.parametrize("extra, message", [
    (["--eval-every", "2"], "--eval-every need(s) --val-data PATH"),
    (["--val-data", "VAL", "--eval-every", "0"], "--eval-every must be >= 1"),
    (["--val-data", "VAL", "--best-metric", "loss"], "--best-metric keeps the best model in "
     "DIR/best: give --checkpoint"),
    (["--val-data", "VAL", "--best-metric", "dice", "--checkpoint", "CK"],
     "--best-metric dice needs masks"),
    (["--val-data", "SMALL"], "but --image-size is 16"),
    (["--val-data", "NOWHERE"], "--val-data "),
    (["--val-data", "VAL", "--num-classes", "2"], "has 3 classes but the model has 2"),
    (["--val-data", "MASKS"], "has masks of 16x16 but the model's output is 2x10"),
])
def test_bad_validation_flags_are_errors_before_training(tmp_path, capsys, extra, message):
    write_val(tmp_path / "val", n=3)
    write_val(tmp_path / "small", n=3, size=8)
    paths = {"VAL": tmp_path / "val", "SMALL": tmp_path / "small", "CK": tmp_path / "ck",
             "NOWHERE": tmp_path / "nowhere",
             "MASKS": load_case(f"{CASES_FILE}::write_csv")(tmp_path / "masks", 2)}
    argv = [f"{CASES_FILE}:tiny_net", "--image-size", "16", "--batch-size", "2", "--steps",
            "1", *(str(paths.get(a, a)) for a in extra)]
    assert run.main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "step " not in captured.out, captured.err


def test_fxpar_run_validates_at_the_end_by_default_and_writes_the_eval_key(tmp_path, capsys):
    write_val(tmp_path / "val", n=5)
    metrics = tmp_path / "m.json"
    argv = [f"{CASES_FILE}:tiny_net", "--image-size", "16", "--batch-size", "2", "--steps",
            "3", "--dtype", "float64", "--num-classes", "3", "--val-data",
            str(tmp_path / "val"), "--metrics", str(metrics)]
    assert run.main(argv) == 0
    out = capsys.readouterr().out
    assert "validation: " in out and "(5 samples, classify, 3 batches of 2)" in out
    evals = [line for line in out.splitlines() if line.startswith("eval ")]
    assert len(evals) == 1 and "step    3/3" in evals[0] and "/5)" in evals[0]
    m = load_metrics(metrics)
    assert [e["step"] for e in m["eval"]] == [3] and m["eval"][0]["samples"] == 5
    data = json.loads(metrics.read_text())
    data["eval"][0].pop("loss")
    metrics.write_text(json.dumps(data))
    with pytest.raises(MetricsError, match=r"eval\[0\] has no 'loss'"):
        load_metrics(metrics)


def test_public_names_stay_importable_from_fxpar_cli_run():
    for name in ("parser", "setup", "train", "finish", "main", "Job"):
        assert callable(getattr(run, name))


# -- under mpiexec ------------------------------------------------------------------------------
BATCH = Batch(CASES, n=4, timeout=240)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_eval_case(results, case):
    check(results, case)

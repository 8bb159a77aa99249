"""Tests of the tests: the transparency harness (tests/helpers/transparency.py,
tests/helpers/equivalence.py) reports small errors, element by element, and names the tensor and
the element.

The mutation cases (tests/mpi/cases/harness_cases.py) run under one real ``mpiexec`` on 2 ranks: an
exact check passes unmutated, and fails for one gradient element off by 1e-6 relative, one
dropped halo row, two swapped micro-batches and a left-out weight-gradient pass; the last
case lets the failure raise and end the launch, as in the real suites."""

import re

import pytest
import torch
from helpers.equivalence import ATOL64, CHUNK, RTOL64, assert_same
from helpers.launch import CASES, launch

CASES = CASES / "harness_cases.py"
NAMES = ["case_unmutated_checks_pass", "case_gradient_element_off_by_1e6_relative",
         "case_dropped_halo_row", "case_swapped_microbatches", "case_dropped_weight_pass",
         "case_gradient_error_fails_the_case"]  # the one that raises comes last: no relaunch
IDS = [f"{CASES}::{n}" for n in NAMES]


# -- assert_same, in process ---------------------------------------------------------------------
def test_small_entry_next_to_a_big_one_gets_no_slack_from_it():
    want = torch.tensor([[1e3, 1e-3], [5.0, -6.0]], dtype=torch.float64)
    got = want.clone()
    got[0, 1] *= 1 + 1e-5  # 1e-8 off: far below 1e-7 x the largest entry (1e-4)
    with pytest.raises(AssertionError) as e:
        assert_same("grad of w", got, want, ATOL64, RTOL64)
    assert str(e.value).startswith(
        f"grad of w: 1 of 4 elements differ; worst at index [0, 1]: got {got[0, 1].item()!r}, "
        f"want {want[0, 1].item()!r} (|diff| 1.000e-08, relative 1.000e-05; ")
    assert_same("grad of w", want * (1 + 0.5 * RTOL64), want, 0.0, RTOL64)  # within rtol


def test_worst_element_is_the_one_furthest_beyond_its_own_allowance():
    want = torch.tensor([100.0, 1.0, 0.0], dtype=torch.float64)
    got = want + torch.tensor([1e-4, 1e-5, 1e-8], dtype=torch.float64)
    with pytest.raises(AssertionError, match=r"3 of 3 elements differ; worst at index \[1\]"):
        assert_same("x", got, want, 1e-9, 1e-7)  # allowances 1e-5, 1.01e-7, 1e-9


@pytest.mark.parametrize("bad, where", [(float("nan"), "[2]"), (float("inf"), "[2]")])
def test_nan_and_inf_fail_and_are_named(bad, where):
    want = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    got = want.clone()
    got[2] = bad
    with pytest.raises(AssertionError, match=re.escape(f"worst at index {where}: got {bad!r}")):
        assert_same("y", got, want)
    same = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=torch.float64)
    assert_same("z", same.clone(), same)  # NaN where want has NaN, the same infinities


@pytest.mark.parametrize("where", [0, CHUNK - 1, CHUNK, 2 * CHUNK + 1])
def test_one_bad_element_in_any_chunk_of_a_big_tensor_is_found(where):
    """A tensor of several chunks (assert_same's fast path compares a chunk at a time): one
    element 1e-8 relative off, in the first, at the end of one, at the start of the next or in
    the short last chunk, is named; so is an infinite want there."""
    want = torch.linspace(1.0, 2.0, 2 * CHUNK + 2, dtype=torch.float64).reshape(-1, 5)
    got = want.clone()
    got.view(-1)[where] *= 1 + 1e-8
    index = [where // 5, where % 5]
    with pytest.raises(AssertionError, match=re.escape(f"1 of {want.numel()} elements differ; "
                                                       f"worst at index {index}")):
        assert_same("grad of w", got, want)
    assert_same("grad of w", want * (1 + 0.5 * RTOL64), want, 0.0, RTOL64)
    want.view(-1)[where] = float("inf")
    with pytest.raises(AssertionError, match=re.escape(f"worst at index {index}")):
        assert_same("grad of w", want.nan_to_num(posinf=5.0), want)


@pytest.mark.parametrize("got", [5.0, -float("inf"), float("nan")])
def test_an_infinite_want_is_equal_only_to_itself(got):
    """|got - inf| <= atol + rtol * inf holds for any finite ``got``: an infinite ``want`` must
    not be an allowance (it was: a finite or opposite infinite ``got`` passed there)."""
    want = torch.tensor([1.0, float("inf")], dtype=torch.float64)
    with pytest.raises(AssertionError, match=r"1 of 2 elements differ; worst at index \[1\]"):
        assert_same("w", torch.tensor([1.0, got], dtype=torch.float64), want)


def test_shape_none_and_scalar_losses():
    with pytest.raises(AssertionError, match=r"shape \(2,\) != \(1, 2\)"):
        assert_same("s", torch.zeros(2), torch.zeros(1, 2))
    with pytest.raises(AssertionError, match="one side is None"):
        assert_same("g", None, torch.zeros(1))
    assert_same("g", None, None)
    with pytest.raises(AssertionError, match=r"step 0 loss: 1 of 1 elements differ; worst at "
                                             r"index \[\]: got 1\.0, want 1\.1 "):
        assert_same("step 0 loss", 1.0, 1.1, ATOL64, RTOL64)


# -- mutations under mpiexec ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def results():
    return launch(IDS, n=2, timeout=600)


@pytest.mark.mpi
@pytest.mark.parametrize("case", IDS[:-1], ids=NAMES[:-1])
def test_mutation_is_reported(results, case):
    """Each mutated check reports the tensor and element it broke (asserted on the ranks); the
    unmutated one passes."""
    results[case].check()
    print(f"{case.split('::')[1]}: {results[case].seconds:.1f} s on rank 0")
    name = case.split("::")[1]
    for line in results[case].output.splitlines():
        if line.startswith(f"harness: {name}: "):
            print(line)


@pytest.mark.mpi
def test_failure_reaches_the_launch_report(results):
    res = results[IDS[-1]]
    assert not res.passed, "a gradient element off by 1e-6 relative passed the harness"
    assert re.search(r"AssertionError: step 0 grad of 3\.weight: 1 of 576 elements differ; "
                     r"worst at index \[\d, \d, \d, \d\]: got -?\d\S*, want -?\d\S* "
                     r"\(\|diff\| \S+, relative 1\.000e-06; ", res.report), res.report
    assert "timeout" not in res.report, res.report

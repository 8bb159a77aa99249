"""What the tests share: the transparency check and its tolerances (transparency, equivalence),
one launch of many MPI cases (launch), torch bugs the references work around (torchbugs), the
error catalogue docs/errors.md is rendered from (errors_*), and the random-model fuzzer (fuzz).

``tests/`` is on ``sys.path`` (pyproject's ``pythonpath``, and each rank's PYTHONPATH), so a
test or case imports ``from helpers.transparency import Case, check``."""

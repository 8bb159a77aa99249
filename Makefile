# fxpar: `make test` and `make demo` each set up .venv on a fresh machine, then run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fxpar-installed
export OMP_NUM_THREADS ?= 1

.PHONY: install test test-full test-quick lint demo clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -qq --upgrade pip
	$(PY) -m pip install -qq -e ".[test,viz]"
	$(PY) -c "import torch, torchvision, mpi4py.MPI; print('torch', torch.__version__, \
	'torchvision', torchvision.__version__, 'MPI', mpi4py.MPI.Get_library_version().split(chr(10))[0])"
	touch $@

lint: $(STAMP)
	$(VENV)/bin/ruff check fxpar passes models tools tests examples
	$(PY) tools/check_imports.py

# tests/streams.py: tests/unit beside the files bound by wall time, then two streams of tests/mpi
# (the files sharing one 8-rank launch, the rest); each stream's report as it ends
test: $(STAMP) lint
	$(PY) tests/streams.py

# every long matrix too (docs/testing.md): every library model and 3-D model under every plan,
# every loss under every plan
test-full: $(STAMP) lint
	FXPAR_LIBRARY_MATRIX=1 FXPAR_VOLUME_MATRIX=1 FXPAR_LOSS_MATRIX=1 $(PY) tests/streams.py

# the edit loop: the one-process tests (tests/unit) without the slow ones, no mpiexec
test-quick: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n 2 -m "not slow" tests/unit

demo: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) tools/demo.py

clean:
	rm -rf $(VENV) build *.egg-info

# fxpar: `make test` and `make demo` each set up .venv on a fresh machine, then run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fxpar-installed
# the oldest torch fxpar supports, in its own environment (make test-oldest-torch)
OLDEST := torch==2.11.0 torchvision==0.26.0
OLD    := .venv-oldest-torch
OLD_STAMP := $(OLD)/.fxpar-installed
export OMP_NUM_THREADS ?= 1

.PHONY: install test test-full test-quick test-oldest-torch lint demo gpu-check clean

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

# the core subset (tests/streams.py CORE_*) on the oldest supported torch: CI runs it after
# `make test`, so both ends of the tested range are checked
test-oldest-torch: $(OLD_STAMP)
	$(OLD)/bin/python tests/streams.py --core

$(OLD_STAMP): pyproject.toml
	test -x $(OLD)/bin/python || $(PYTHON) -m venv $(OLD)
	$(OLD)/bin/python -m pip install -qq --upgrade pip
	printf '%s\n' $(OLDEST) > $(OLD)/constraints.txt
	$(OLD)/bin/python -m pip install -qq -c $(OLD)/constraints.txt -e . $(OLDEST) mpi4py mpich \
	    pytest pytest-timeout hypothesis "timm>=1.0.20,<1.1" \
	    "segmentation-models-pytorch>=0.5,<0.7" "monai>=1.5,<1.7"
	touch $@

demo: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) tools/demo.py

# one GPU node, one command that ends within 8 minutes (tools/gpu_check.py): the GPU
# transparency tests, then docs/gpu.md. It runs the node's own python3 (no .venv; fxpar is
# installed editable if it is not importable); without a GPU it says so in one line, exit 0
gpu-check:
	@$(PYTHON) tools/gpu_check.py

clean:
	rm -rf $(VENV) $(OLD) build *.egg-info

# fxpar: `make test` and `make demo` each set up .venv on a fresh machine, then run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fxpar-installed
export OMP_NUM_THREADS ?= 1

.PHONY: install test test-quick lint demo clean

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

# tests/unit (one process, one core) runs beside tests/mpi, whose oversubscribed ranks leave
# about a third of the cores idle between and inside launches; its report follows the MPI one
test: $(STAMP) lint
	@rm -f .test-unit.log .test-unit.rc
	@( $(PY) -m pytest -q -p no:cacheprovider --durations=5 tests/unit > .test-unit.log 2>&1; \
	   echo $$? > .test-unit.rc ) & \
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -p no:cacheprovider --durations=15 \
	    tests/mpi; mpi=$$?; wait; \
	echo "== tests/unit (ran beside tests/mpi) =="; cat .test-unit.log; \
	test "$$mpi" = 0 && test "$$(cat .test-unit.rc)" = 0

# the edit loop: the one-process tests (tests/unit) without the slow ones, no mpiexec
test-quick: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests/unit

demo: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) tools/demo.py

clean:
	rm -rf $(VENV) build *.egg-info

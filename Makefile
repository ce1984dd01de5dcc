# Set-up and everyday commands. `make test` and `make demo` install into .venv/ first if needed.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test test-fast lint demo clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,demo,onnx,images]'
	# the model front ends' tests: torch's CPU build, pinned exactly (see the `torch` extra)
	$(PY) -m pip install --quiet --disable-pip-version-check 'torch==2.13.0'
	touch $(STAMP)

# Everything, MPI and packaging included.
test: $(STAMP)
	$(PY) -m pytest -q

# The inner loop: leaves out the tests marked slow (MPI jobs, packaging, VGG-A-size nets).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# ruff over the tree, mypy over the two packages (configured in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

demo: $(STAMP)
	$(VENV)/bin/mpiexec -n 2 $(PY) examples/train.py --threads 1 --plot build/digits_curve.png

clean:
	rm -rf build dist *.egg-info

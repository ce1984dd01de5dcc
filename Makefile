# Set-up and everyday commands. `make test` and `make demo` install into .venv/ first if needed.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test demo clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,demo]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/mpiexec -n 2 $(PY) examples/train.py --threads 1 --plot build/digits_curve.png

clean:
	rm -rf build dist *.egg-info

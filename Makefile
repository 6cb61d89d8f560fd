# `make demo` and `make test` create .venv (pinned versions) when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=23.2"
	$(PY) -m pip install --quiet torch==2.13.0 "setuptools>=68" wheel
	$(PY) -m pip install --quiet --no-build-isolation -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo_gpt.py

test: $(STAMP)
	$(VENV)/bin/ruff check torch_pjrt tests bench examples
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) bench/dispatch_overhead.py
	$(PY) bench/train_step.py

clean:
	rm -rf $(VENV) build *.egg-info torch_pjrt/_hooks*.so

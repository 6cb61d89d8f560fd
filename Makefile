# `make demo` and `make test` create .venv (pinned versions) when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench battery-ops venv clean

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
	$(VENV)/bin/ruff check torch_pjrt tests bench examples battery
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) bench/dispatch_overhead.py
	$(PY) bench/train_step.py
	$(PY) bench/first_step.py

# OpInfo battery: every op_db entry on pjrt vs CPU in 2 worker processes; writes docs/op-coverage.md and
# torch_pjrt/data/op_coverage.json. BATTERY_ARGS="--max-samples 4" gives a sampled run.
BATTERY_ARGS ?=
battery-ops: $(STAMP)
	$(PY) -m battery.run_opinfo --jobs 2 --fresh --report $(BATTERY_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info torch_pjrt/_hooks*.so

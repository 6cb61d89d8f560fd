# `make demo` and `make test` create .venv (pinned versions) when it is missing.
# Targets with environments of their own (serving, TorchTitan, other libraries) live in make/*.mk, one file each.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-python-dispatch bench battery-ops battery-errors battery-device-tests zoo venv clean

venv: $(STAMP)

# A virtual environment at $(1) holding pip and the pinned CPU torch before anything else, so that no later
# requirement can make pip resolve another torch build (an unpinned torch is a multi-GB CUDA download).
# jaxlib (pyproject.toml's pin, read from there) too: pip builds the package before installing its dependencies,
# and torch_pjrt._xla_cpu_kernels needs jaxlib's FFI headers to build (setup.py).
JAXLIB_PIN := $(shell grep -o 'jaxlib==[0-9.]*' pyproject.toml)
define new_venv
test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
$(1)/bin/python -m pip install --quiet --upgrade "pip>=23.2"
$(1)/bin/python -m pip install --quiet torch==2.13.0 $(JAXLIB_PIN) "setuptools>=68" wheel
endef

$(STAMP): pyproject.toml
	$(call new_venv,$(VENV))
	$(PY) -m pip install --quiet --no-build-isolation -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo_gpt.py

# Two pytest workers (pytest-xdist), one test file at a time each: most tests run one single-threaded
# XLA compile or program after another, so a second worker uses CI's second core.
test: $(STAMP)
	$(VENV)/bin/ruff check torch_pjrt tests bench examples battery
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=20 tests

# The whole suite with the native hit path off (every eager op through its Python kernel), for bisecting;
# `make test` runs tests/test_native_dispatch.py, which compares both paths bit for bit.
test-python-dispatch: $(STAMP)
	TORCH_PJRT_NATIVE_DISPATCH=0 $(PY) -m pytest -q -n 2 --dist loadfile tests

bench: $(STAMP)
	$(PY) bench/dispatch_overhead.py
	$(PY) bench/generate_tokens.py
	$(PY) bench/train_step.py
	$(PY) bench/step_breakdown.py
	$(PY) bench/first_step.py
	$(PY) bench/dynamic_lengths.py

# OpInfo battery: every op_db entry on pjrt vs CPU in 2 worker processes (first 4 samples per cell in
# float32, 2 in the other dtypes; raise the caps for a longer run, or empty them for every sample:
# `make battery-ops FLOAT32_SAMPLES= OTHER_SAMPLES=`); writes docs/op-coverage.md,
# torch_pjrt/data/op_coverage.json and the rows in docs/opinfo-results.jsonl.gz.
FLOAT32_SAMPLES ?= 4
OTHER_SAMPLES ?= 2
battery-ops: $(STAMP)
	$(PY) -m battery.run_opinfo --jobs 2 --fresh --no-report --dtypes float32 \
		$(if $(FLOAT32_SAMPLES),--max-samples $(FLOAT32_SAMPLES))
	$(PY) -m battery.run_opinfo --jobs 2 --no-report $(if $(OTHER_SAMPLES),--max-samples $(OTHER_SAMPLES)) \
		--dtypes float64 bfloat16 int64 complex64 float16 int32 bool float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz
	$(PY) -m battery.report build/opinfo/results.jsonl --save-rows docs/opinfo-results.jsonl.gz

# Bad-input battery: every OpInfo ErrorInput and ERROR_EXAMPLES hypothesis cases per property (battery/properties.py),
# CPU vs pjrt, in 2 worker processes; writes docs/bad-input.md.
ERROR_EXAMPLES ?= 200
battery-errors: $(STAMP)
	$(PY) -m battery.run_errors --jobs 2 --examples $(ERROR_EXAMPLES)

# OpInfo consistency tests through PyTorch's instantiate_device_type_tests (PrivateUse1 base);
# writes docs/device-tests.md. Known failures: battery/device_skips.py.
battery-device-tests: $(STAMP)
	mkdir -p build
	-$(PY) -m pytest battery/device_tests.py -q -p no:cacheprovider --junitxml build/device-tests.xml -o junit_family=xunit1
	$(PY) -m battery.device_report build/device-tests.xml

# Model zoo: Hugging Face architectures shrunk to a small size (random weights, nothing downloaded) on pjrt
# against CPU, forward and one training step, in 2 worker processes for ZOO_MINUTES; writes
# docs/model-coverage.md (models not reached in time are listed as not run). Failures do not stop make.
ZOO_TASKS ?= all
ZOO_MINUTES ?= 40
zoo: $(STAMP)
	mkdir -p build/zoo
	-HF_HUB_OFFLINE=1 $(PY) -m torch_pjrt zoo --task $(ZOO_TASKS) --jobs 2 --timeout 180 --budget-minutes $(ZOO_MINUTES) \
		--report docs/model-coverage.md --json build/zoo/results.json --log build/zoo/workers.log

clean:
	rm -rf $(VENV) $(EXTRA_VENVS) build *.egg-info torch_pjrt/_hooks*.so torch_pjrt/_xla_cpu_kernels*.so

include $(wildcard make/*.mk)

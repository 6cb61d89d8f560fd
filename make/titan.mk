# TorchTitan on pjrt (tests/test_titan.py, docs/torchtitan.md) in an environment of its own: TorchTitan's
# dependencies (datasets, torchdata, tyro, ...) stay out of .venv. torch is pinned first so that no
# requirement can pull another build; torchtitan itself comes without its declared dependencies
# (tests/fixtures/titan/requirements.txt lists the ones it imports, resolved together with this
# project's pinned [dev] extra in one pip call).
TITAN_VENV ?= .venv-titan
TITAN_STAMP := $(TITAN_VENV)/.installed
TITAN_REQUIREMENTS := tests/fixtures/titan/requirements.txt

.PHONY: test-titan
EXTRA_VENVS += $(TITAN_VENV)

$(TITAN_STAMP): pyproject.toml $(TITAN_REQUIREMENTS)
	$(call new_venv,$(TITAN_VENV))
	$(TITAN_VENV)/bin/python -m pip install --quiet --no-build-isolation -r $(TITAN_REQUIREMENTS) -e ".[dev]"
	$(TITAN_VENV)/bin/python -m pip install --quiet --no-deps torchtitan==0.3.0
	touch $(TITAN_STAMP)

test-titan: $(TITAN_STAMP)
	$(TITAN_VENV)/bin/python -m pytest -q tests/test_titan.py

# Libraries beyond Transformers on pjrt (issue 34: PyTorch Lightning, torchao, diffusers, TRL, Ray Train, timm;
# tests/test_libraries*.py, docs/libraries.md) in an environment of their own. torch is pinned first, and the
# libraries resolve together with this project's pinned [dev] extra in one pip call
# (tests/fixtures/libs/requirements.txt pins torch too), so that no requirement can pull another torch build.
# torchvision 0.28.0 is the release that requires torch==2.13.0; PyPI's wheel is a CUDA build whose C++ ops do not
# load on the CPU torch, and torch_pjrt/integrations/torchvision.py lets its Python parts (all timm needs) import.
LIBS_VENV ?= .venv-libs
LIBS_STAMP := $(LIBS_VENV)/.installed
LIBS_REQUIREMENTS := tests/fixtures/libs/requirements.txt

.PHONY: test-libs
EXTRA_VENVS += $(LIBS_VENV)

$(LIBS_STAMP): pyproject.toml $(LIBS_REQUIREMENTS)
	$(call new_venv,$(LIBS_VENV))
	$(LIBS_VENV)/bin/python -m pip install --quiet --no-build-isolation -r $(LIBS_REQUIREMENTS) -e ".[dev]"
	touch $(LIBS_STAMP)

test-libs: $(LIBS_STAMP)
	$(LIBS_VENV)/bin/python -m pytest -q tests/test_libraries*.py

# timm's image models on pjrt against CPU (one per timm module, its model with the fewest parameters, random
# weights): docs/model-coverage-timm.md.
ZOO_TIMM_MINUTES ?= 120
ZOO_JOBS ?= 1
.PHONY: zoo-timm
zoo-timm: $(LIBS_STAMP)
	mkdir -p build/zoo
	-$(LIBS_VENV)/bin/python -m torch_pjrt zoo --library timm --jobs $(ZOO_JOBS) --timeout 240 \
		--budget-minutes $(ZOO_TIMM_MINUTES) --report docs/model-coverage-timm.md --json build/zoo/timm.json \
		--log build/zoo/timm-workers.log

# Every model class diffusers exports under diffusers.models, shrunk, random weights, on pjrt against CPU:
# docs/model-coverage-diffusers.md, its rows in docs/model-coverage-diffusers.json. With
# ZOO_DIFFUSERS_NAME='^(A|B)$' only those classes run and their rows replace theirs in that JSON (zoo --merge):
# the report is regenerated from the merged rows and its header names the re-run.
ZOO_DIFFUSERS_MINUTES ?= 60
ZOO_DIFFUSERS_JSON := docs/model-coverage-diffusers.json
.PHONY: zoo-diffusers
zoo-diffusers: $(LIBS_STAMP)
	mkdir -p build/zoo
	-$(LIBS_VENV)/bin/python -m torch_pjrt zoo --library diffusers --jobs $(ZOO_JOBS) --timeout 300 \
		$(if $(ZOO_DIFFUSERS_NAME),--name '$(ZOO_DIFFUSERS_NAME)' --merge $(ZOO_DIFFUSERS_JSON)) \
		--budget-minutes $(ZOO_DIFFUSERS_MINUTES) --report docs/model-coverage-diffusers.md \
		--json $(ZOO_DIFFUSERS_JSON) --log build/zoo/diffusers-workers.log

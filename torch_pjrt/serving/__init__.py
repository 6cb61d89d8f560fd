"""Serving models on pjrt devices: integrations with serving engines (vLLM's platform plugin in `vllm/`).

Nothing below this layer imports it, and importing it never imports a serving engine: the engine loads
its own entry points (see pyproject.toml) when it runs.
"""

"""The small Llama the generate() benchmarks run: random weights from seed 0, one copy on CPU, one on pjrt."""

from __future__ import annotations

from typing import Any


def cpu_and_pjrt_llama() -> tuple[Any, Any]:
    """A 4-layer Llama (width 128, vocabulary 256) in eval mode on CPU, and the same weights on pjrt."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cpu = LlamaForCausalLM(config).eval()
    pjrt = LlamaForCausalLM(config).eval()
    pjrt.load_state_dict(cpu.state_dict())
    return cpu, pjrt.to("pjrt")

"""Hugging Face generate() with a static cache and the forward compiled by torch.compile(backend="pjrt")."""

from __future__ import annotations

import pytest
import torch

import torch_pjrt


def graph_compiles() -> int:
    return torch_pjrt.metrics.counters()["graph_compiles"]


@pytest.mark.parametrize("eager_mode", ["defer_never", "defer_and_fuse"])
def test_compiled_static_cache_generation_gives_cpus_tokens_and_replays_its_decode_graph(eager_mode: str) -> None:
    """The eager ops generate() runs between forwards, strict or fused, and the compiled graphs: CPU's tokens."""
    transformers = pytest.importorskip("transformers")
    torch.compiler.reset()
    torch.manual_seed(21)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cpu = transformers.LlamaForCausalLM(config).eval()
    dev = transformers.LlamaForCausalLM(config).eval()
    dev.load_state_dict(cpu.state_dict())
    dev = dev.to("pjrt")
    dev.forward = torch.compile(dev.forward, backend="pjrt")
    options = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
                   cache_implementation="static")
    new_graphs = []
    for _ in range(2):  # a second prompt of the same length: the same prefill and decode graphs
        ids = torch.randint(1, 96, (1, 7))
        with torch.no_grad():
            want = cpu.generate(ids, attention_mask=torch.ones_like(ids), **options)
            before = graph_compiles()
            with torch_pjrt.set_eager_mode(eager_mode):
                got = dev.generate(ids.to("pjrt"), attention_mask=torch.ones_like(ids).to("pjrt"), **options)
            new_graphs.append(graph_compiles() - before)
        assert torch.equal(got.cpu(), want)
    assert new_graphs[0] >= 2 and new_graphs[1] == 0, new_graphs

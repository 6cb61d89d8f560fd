"""Hugging Face generate() with a static cache and the forward compiled by torch.compile(backend="pjrt")."""

from __future__ import annotations

import pytest
import torch

import torch_pjrt


def graph_compiles() -> int:
    return torch_pjrt.metrics.counters()["graph_compiles"]


def cpu_and_compiled_llama(seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A 2-layer Llama (width 64) from `seed` on CPU, and the same weights on pjrt with its forward compiled."""
    transformers = pytest.importorskip("transformers")
    torch.compiler.reset()
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cpu = transformers.LlamaForCausalLM(config).eval()
    dev = transformers.LlamaForCausalLM(config).eval()
    dev.load_state_dict(cpu.state_dict())
    dev = dev.to("pjrt")
    dev.forward = torch.compile(dev.forward, backend="pjrt")
    return cpu, dev


@pytest.mark.parametrize("eager_mode", ["defer_never", "defer_and_fuse"])
def test_compiled_static_cache_generation_gives_cpus_tokens_and_replays_its_decode_graph(eager_mode: str) -> None:
    """The eager ops generate() runs between forwards, strict or fused, and the compiled graphs: CPU's tokens."""
    cpu, dev = cpu_and_compiled_llama(21)
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


def test_the_static_caches_buffers_are_donated_and_updated_in_place_by_each_replayed_decode_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each decode call writes the static cache's keys, values and lengths into the device buffers they had (the
    program's donated inputs), not into copies, and the calls after the first are replayed natively: CPU's tokens."""
    from torch_pjrt import storage
    from torch_pjrt.compile import backend, native_call
    from torch_pjrt.runtime import client

    if native_call.module() is None:
        pytest.skip("the native graph call is not built")
    cpu, dev = cpu_and_compiled_llama(22)
    options = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static")
    ids = torch.randint(1, 96, (1, 7))
    calls: list[tuple[int, int, bool]] = []  # per graph call: storages written, of them kept in place, replayed
    graph_call = backend.CompiledGraph.__call__

    def buffers(tensors: list[torch.Tensor]) -> list[int]:
        arrays = [storage.storage_of(tensor).array for tensor in tensors]
        client.jax_module().block_until_ready(arrays)
        return [array.unsafe_buffer_pointer() for array in arrays]

    def watched(graph: backend.CompiledGraph, *args: object) -> object:
        written = [args[index] for index, _ in graph.mutations]
        before, hits = buffers(written), sum(found.native.hits for found in graph.programs.values() if found.native)
        results = graph_call(graph, *args)
        replayed = sum(found.native.hits for found in graph.programs.values() if found.native) > hits
        calls.append((len(written), sum(old == new for old, new in zip(before, buffers(written))), replayed))
        return results

    with torch.no_grad():
        want = cpu.generate(ids, attention_mask=torch.ones_like(ids), **options)
        dev.generate(ids.to("pjrt"), attention_mask=torch.ones_like(ids).to("pjrt"), **options)  # compiles
        monkeypatch.setattr(backend.CompiledGraph, "__call__", watched)
        got = dev.generate(ids.to("pjrt"), attention_mask=torch.ones_like(ids).to("pjrt"), **options)
    assert torch.equal(got.cpu(), want)
    decode = calls[1:]
    assert len(decode) == 7, calls
    # two layers: each layer's keys, values and cumulative length
    assert all(written == 6 and kept == written and replayed for written, kept, replayed in decode), calls

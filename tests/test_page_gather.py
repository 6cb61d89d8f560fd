"""kernels/page_gather.py: gather_pages (a paged KV cache's pages by block table) against torch on CPU, with its CPU
custom call (torch_pjrt._xla_cpu_kernels), its fallback (XLA's gathers) and its out-of-range block ids."""

from __future__ import annotations

import functools
import sys

import jax
import numpy as np
import pytest
import torch

import torch_pjrt
from torch_pjrt import _torch_private, kernels
from torch_pjrt.kernels import page_gather
from torch_pjrt.runtime import checks

LAYERS, BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_SIZE = 3, 10, 2, 4, 8


def random_inputs(dtype: torch.dtype, tokens: int = 5, pages: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache of random rows and block tables of random ids, out of order, one page named twice in a row and
    one shared by two tokens (prefix caching), one id negative (counted from the end, as torch indexes)."""
    cache = torch.randn(LAYERS, BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE).to(dtype)
    tables = torch.stack([torch.randperm(BLOCKS)[:pages] for _ in range(tokens)])
    tables[0, 1] = tables[0, 0]
    tables[2, 0] = tables[1, 2]
    tables[3, 2] -= BLOCKS
    return cache, tables


def expected_pages(cache: torch.Tensor, tables: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token t's context position s: row s % block_size of page tables[t, s // block_size], one token at a time."""
    keys, values = [], []
    for table in tables:
        rows = cache[layer][table]  # (pages, kv_heads, block_size, 2 * head_size)
        rows = rows.permute(1, 0, 2, 3).reshape(KV_HEADS, -1, 2 * HEAD_SIZE)
        keys.append(rows[..., :HEAD_SIZE])
        values.append(rows[..., HEAD_SIZE:])
    return torch.stack(keys), torch.stack(values)


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("whole_buffer", [True, False])
def test_gather_pages_matches_torch_on_cpu(mode: str, dtype: torch.dtype, whole_buffer: bool) -> None:
    cache, tables = random_inputs(dtype)
    layer = 1
    want = expected_pages(cache, tables, layer)
    arguments = (cache, tables, torch.tensor([layer])) if whole_buffer else (cache[layer], tables)
    torch.testing.assert_close(page_gather.gather_pages(*arguments), want, rtol=0, atol=0)  # the CPU kernel
    eager = torch_pjrt.EagerMode.DEFER_AND_FUSE if mode == "fused" else torch_pjrt.EagerMode.DEFER_NEVER
    with torch.pjrt.set_eager_mode(eager):
        keys, values = page_gather.gather_pages(*(t.to("pjrt") for t in arguments))
        got = keys.cpu(), values.cpu()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gather_pages_in_a_compiled_graph_matches_torch_on_cpu(dtype: torch.dtype) -> None:
    """One compiled graph over two step shapes (more tokens, a wider table): exact copies of the pages."""

    def step(cache: torch.Tensor, tables: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
        keys, values = page_gather.gather_pages(cache, tables, layer)
        return torch.cat([keys, values], -1) * 2

    compiled = torch.compile(step, backend="pjrt", fullgraph=True)
    layer = torch.tensor([2])
    for tokens, pages in ((5, 3), (8, 4)):
        cache, tables = random_inputs(dtype, tokens, pages)
        got = compiled(cache.to("pjrt"), tables.to("pjrt"), layer.to("pjrt")).cpu()
        torch.testing.assert_close(got, torch.cat(expected_pages(cache, tables, 2), -1) * 2, rtol=0, atol=0)


def test_gathered_attention_compiled_matches_eager_on_cpu() -> None:
    """paged.gathered_attention, which reads its keys and values through gather_pages, compiled, GQA (4 query
    heads over 2 kv heads), against the same function on CPU tensors (gather_pages's CPU kernel)."""
    from torch_pjrt.kernels import paged

    cache, tables = random_inputs(torch.float32, tokens=6, pages=3)
    query = torch.randn(6, 4, HEAD_SIZE)
    visible = torch.arange(3 * BLOCK_SIZE)[None, :] <= torch.tensor([0, 3, 5, 8, 11, 2])[:, None]
    layer = torch.tensor([1])
    attend = functools.partial(_torch_private.traced_by_dynamo(paged.gathered_attention), scale=0.3, soft_cap=0.0)
    want = attend(query, cache, tables, visible, layer=layer)
    compiled = torch.compile(lambda *a: attend(*a[:4], layer=a[4]), backend="pjrt", fullgraph=True)
    got = compiled(*(t.to("pjrt") for t in (query, cache, tables, visible, layer))).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gather_pages_checks_its_schema_and_fake() -> None:
    cache, tables = random_inputs(torch.float32)
    arguments = tuple(t.to("pjrt") for t in (cache, tables, torch.tensor([0])))
    tests = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    assert kernels.opcheck(page_gather.gather_pages, arguments, test_utils=tests) == dict.fromkeys(tests, "SUCCESS")
    with pytest.raises(ValueError, match=r"gather_pages: the cache must be .* got cache \(3, 10, 2, 4, 16\), "
                                         r"layer None"):
        page_gather.gather_pages(arguments[0], arguments[1])
    with pytest.raises(ValueError, match=r"gather_pages: .* layer \(2,\) and"):
        page_gather.gather_pages(arguments[0], arguments[1], torch.tensor([0, 1], device="pjrt"))


def _jax_inputs(tables: torch.Tensor | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    cache, random_tables = random_inputs(torch.float32)
    tables = random_tables if tables is None else tables
    return (jax.numpy.asarray(cache.numpy()), jax.numpy.asarray(tables.numpy().astype(np.int32)),
            jax.numpy.asarray(np.array([1], np.int32)))


def test_the_custom_call_and_xla_gathers_agree() -> None:
    """The lowering with the CPU custom call and its fallback (XLA's gathers: other platforms, no extension)."""
    if page_gather.native_target() is None:
        pytest.skip("torch_pjrt._xla_cpu_kernels is not built (no jaxlib headers at build time)")
    arguments = _jax_inputs()
    native, fallback = (jax.jit(functools.partial(page_gather._gather_pages, native=flag))(*arguments)
                        for flag in (True, False))
    for mine, xla in zip(native, fallback, strict=True):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(xla))
    lowered = jax.jit(functools.partial(page_gather._gather_pages, native=True)).lower(*arguments).as_text()
    assert page_gather.TARGET in lowered


def test_other_platforms_lower_to_xla_gathers() -> None:
    """Lowered for GPU (no GPU needed), the program has XLA's gathers and no CPU custom call."""
    arguments = _jax_inputs()
    exported = jax.export.export(jax.jit(functools.partial(page_gather._gather_pages, native=True)),
                                 platforms=["cuda"])(*arguments)
    text = exported.mlir_module()
    assert page_gather.TARGET not in text and "gather" in text


def test_without_the_extension_the_op_uses_xla_gathers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_pjrt._xla_cpu_kernels", None)  # its import raises ImportError
    assert page_gather.native_target.__wrapped__() is None


def test_out_of_range_block_ids_raise_and_read_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    cache, tables = random_inputs(torch.float32)
    tables[2, 1] = BLOCKS
    layer = torch.tensor([0])
    message = f"index {BLOCKS} is out of bounds for dimension 1 with size {BLOCKS}"
    with pytest.raises(IndexError, match=message):  # the CPU kernel: torch indexing's error
        page_gather.gather_pages(cache, tables, layer)
    with pytest.raises(checks.DeviceCheckError, match=f"torch_pjrt::gather_pages: {message}"):
        page_gather.gather_pages(cache.to("pjrt"), tables.to("pjrt"), layer.to("pjrt"))[0].cpu()
    with pytest.raises(checks.DeviceCheckError, match="index 3 is out of bounds for dimension 0 with size 3"):
        page_gather.gather_pages(cache.to("pjrt"), tables.clamp(0, BLOCKS - 1).to("pjrt"),
                                 torch.tensor([3], device="pjrt"))[1].cpu()
    # the custom call itself (no check traced outside an executor) reads nothing for ids far outside the cache
    if page_gather.native_target() is not None:
        far = tables.clone()
        far[2, 1], far[4, 0] = 2**30, -(2**30)
        keys, values = jax.jit(functools.partial(page_gather._gather_pages, native=True))(*_jax_inputs(far))
        assert not np.asarray(keys)[2, :, BLOCK_SIZE:2 * BLOCK_SIZE].any()
        assert not np.asarray(values)[4, :, :BLOCK_SIZE].any()

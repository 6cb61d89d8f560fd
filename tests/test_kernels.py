"""torch_pjrt.kernels: JAX and Pallas functions as PyTorch ops, in every mode, against PyTorch on CPU."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
import torch

import torch_pjrt
from torch_pjrt import kernels, storage
from torch_pjrt.compile import backend as compile_backend
from torch_pjrt.kernels import jax_ops
from torch_pjrt.runtime.metrics import op_counts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import pallas_rms_norm  # noqa: E402 (the docs' worked example: a Pallas RMSNorm with a Pallas backward)

FUSE = torch_pjrt.EagerMode.DEFER_AND_FUSE


@kernels.jax_op("kernels_test::swish", vjp="auto")
def swish(x: jax.Array, beta: float = 1.0) -> jax.Array:
    return x * jax.nn.sigmoid(beta * x)


@kernels.jax_op("kernels_test::scaled_pair", vjp="auto")
def scaled_pair(x: jax.Array, y: jax.Array, labels: jax.Array, *, scale: float) -> tuple[jax.Array, jax.Array]:
    """Two results, a keyword-only static and an integer tensor argument (not differentiated)."""
    return jnp.tanh(x) * y * scale, x * labels[:, None]


@kernels.jax_op("kernels_test::arange_like")
def arange_like(x: jax.Array) -> jax.Array:
    """Python numbers and jnp.arange take jax's default dtypes: what the kernel sees as its mode."""
    return jnp.arange(x.shape[0]) + 1.5


@kernels.jax_op("kernels_test::accumulate", donate_argnums=0, vjp="auto")
def accumulate(total: jax.Array, x: jax.Array) -> jax.Array:
    """An update of its first argument, as in-place kernels written for TorchTPU donate it."""
    return total + x * 2


def swish_cpu(x: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    return x * torch.sigmoid(beta * x)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, pallas_rms_norm.EPS)


def leaves(*tensors: torch.Tensor, device: str) -> list[torch.Tensor]:
    return [t.detach().to(device).requires_grad_(t.is_floating_point()) for t in tensors]


def test_schema_comes_from_the_annotations() -> None:
    assert str(swish._opoverload._schema) == "kernels_test::swish(Tensor x, float beta=1.) -> Tensor"
    assert str(scaled_pair._opoverload._schema) == (
        "kernels_test::scaled_pair(Tensor x, Tensor y, Tensor labels, *, float scale) -> (Tensor, Tensor)")


def test_strict_eager_matches_cpu() -> None:
    x, weight = torch.randn(6, 32), torch.rand(32) + 0.5
    torch.testing.assert_close(swish(x.to("pjrt"), 1.5).cpu(), swish_cpu(x, 1.5))
    torch.testing.assert_close(pallas_rms_norm.rms_norm(x.to("pjrt"), weight.to("pjrt")).cpu(), rms_norm_cpu(x, weight))


def test_fused_mode_records_the_op_into_one_program() -> None:
    x, weight = torch.randn(4, 16), torch.rand(16) + 0.5
    before = torch_pjrt.metrics.counters()["fused_programs"]
    with torch.pjrt.set_eager_mode(FUSE):
        y = pallas_rms_norm.rms_norm(swish(x.to("pjrt")) * 2, weight.to("pjrt")) + 1
        assert torch_pjrt.metrics.counters()["fused_programs"] == before  # recorded, nothing ran yet
        result = y.cpu()
    assert torch_pjrt.metrics.counters()["fused_programs"] == before + 1
    torch.testing.assert_close(result, rms_norm_cpu(swish_cpu(x) * 2, weight) + 1)


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_eager_gradients_match_cpu(mode: str) -> None:
    x, y, weight = torch.randn(5, 8), torch.randn(5, 8), torch.rand(8) + 0.5
    labels = torch.randint(0, 4, (5,))

    def loss(x: torch.Tensor, y: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, on_cpu: bool) -> Any:
        if on_cpu:
            first, second = torch.tanh(x) * y * 0.5, x * labels[:, None]
            return (rms_norm_cpu(swish_cpu(first), weight) * second).sum()
        first, second = scaled_pair(x, y, labels, scale=0.5)
        return (pallas_rms_norm.rms_norm(swish(first), weight) * second).sum()

    expected_leaves = leaves(x, y, labels, weight, device="cpu")
    loss(*expected_leaves, on_cpu=True).backward()
    actual_leaves = leaves(x, y, labels, weight, device="pjrt")
    with torch.pjrt.set_eager_mode(FUSE if mode == "fused" else torch_pjrt.EagerMode.DEFER_NEVER):
        loss(*actual_leaves, on_cpu=False).backward()
        grads = [t.grad.cpu() for t in actual_leaves if t.is_floating_point()]
    for actual, expected in zip(grads, [t.grad for t in expected_leaves if t.is_floating_point()]):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_compiled_forward_and_backward_match_cpu() -> None:
    x, weight = torch.randn(4, 16), torch.rand(16) + 0.5

    def loss(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return pallas_rms_norm.rms_norm(swish(x, 0.7), weight).square().mean()

    expected_x, expected_w = leaves(x, weight, device="cpu")
    expected = rms_norm_cpu(swish_cpu(expected_x, 0.7), expected_w).square().mean()
    expected.backward()
    actual_x, actual_w = leaves(x, weight, device="pjrt")
    compiled = torch.compile(loss, backend="pjrt", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(actual_x, actual_w).cpu(), expected.detach())
    actual = compiled(actual_x, actual_w)
    actual.backward()
    torch.testing.assert_close(actual.detach().cpu(), expected.detach())
    torch.testing.assert_close(actual_x.grad.cpu(), expected_x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(actual_w.grad.cpu(), expected_w.grad, rtol=1e-5, atol=1e-5)


def test_the_worked_example_trains_like_torch_rms_norm() -> None:
    on_pjrt = pallas_rms_norm.train(pallas_rms_norm.make_model(pallas_rms_norm.PallasRMSNorm), "pjrt", steps=2)
    on_cpu = pallas_rms_norm.train(
        pallas_rms_norm.make_model(lambda width: torch.nn.RMSNorm(width, eps=pallas_rms_norm.EPS)), "cpu", steps=2)
    assert on_pjrt[-1] < on_pjrt[0]
    assert max(abs(a - b) for a, b in zip(on_pjrt, on_cpu)) < 1e-4


def test_export_stablehlo_contains_the_kernel() -> None:
    text = torch_pjrt.export_stablehlo(lambda x, w: pallas_rms_norm.rms_norm(swish(x, 2.0), w),
                                       (torch.randn(3, 5), torch.rand(5)))
    assert "stablehlo.exponential" in text and "stablehlo.rsqrt" in text and "tensor<3x5xf32>" in text


def test_opcheck() -> None:
    """Every opcheck test, the autograd registration one included (kernels.opcheck runs it for pjrt)."""
    x, y, weight = torch.randn(3, 8, device="pjrt"), torch.randn(3, 8, device="pjrt"), torch.rand(8, device="pjrt")
    labels = torch.randint(0, 4, (3,), device="pjrt")
    passed = dict.fromkeys(kernels.op_checks.DEFAULT_TEST_UTILS, "SUCCESS")
    assert kernels.opcheck(swish, (x.clone().requires_grad_(), 1.5)) == passed
    assert kernels.opcheck(scaled_pair, (x.clone().requires_grad_(), y, labels), {"scale": 2.0}) == passed
    jax_ops._specialized.discard("example::rms_norm")  # warned once per process
    with pytest.warns(UserWarning, match="example::rms_norm cannot be traced for symbolic sizes"):
        assert kernels.opcheck(pallas_rms_norm.rms_norm, (x, weight.requires_grad_())) == passed


def test_opcheck_finds_a_backward_registered_at_the_backend_key() -> None:
    library = torch.library.Library("kernels_test_bad", "FRAGMENT")
    library.define("twice(Tensor x) -> Tensor")

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad * 2

    def twice(x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            return Twice.apply(x)

    library.impl("twice", twice, "PrivateUse1")
    x = torch.randn(3, device="pjrt", requires_grad=True)
    with pytest.raises(AssertionError, match="kernels_test_bad::twice: an output requires grad but the op has no "
                                             "kernel at an autograd key"):
        kernels.opcheck(torch.ops.kernels_test_bad.twice.default, (x,), test_utils="test_autograd_registration")
    with pytest.raises(RuntimeError, match="needs an input that requires grad"):
        kernels.opcheck(swish, (x.detach(),), test_utils="test_autograd_registration")


@kernels.jax_op("kernels_test::resized")
def resized(x: jax.Array) -> jax.Array:
    """A result whose sizes are floordiv, mod, max and min of the input's: the symbolic fake's arithmetic."""
    rows, cols = x.shape
    flat = x.reshape(-1)
    length = rows // 2 * 3 + cols % 5
    return jnp.zeros((length, -(-cols // 4), 2)) + flat[:1].sum()


def resized_shape(rows: int, cols: int) -> tuple[int, int, int]:
    return rows // 2 * 3 + cols % 5, -(-cols // 4), 2


def test_compiled_with_dynamic_sizes_traces_each_kernel_once_for_all_sizes() -> None:
    """Under dynamic shapes a kernel's fake traces with jax symbolic sizes; one graph serves every size,
    with values and gradients of PyTorch on CPU; a Pallas kernel (whose grid needs sizes) specializes."""
    graphs = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return compile_backend.pjrt_backend(gm, example_inputs)

    def body(x: torch.Tensor, y: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        first, second = scaled_pair(swish(x, 1.5), y, labels, scale=0.5)
        return first.sum(-1), second, resized(x.detach())

    compiled = torch.compile(body, backend=counting, dynamic=True)
    for rows, cols in ((5, 8), (9, 11), (12, 6)):
        x, y = torch.randn(rows, cols), torch.randn(rows, cols)
        labels = torch.randint(0, 4, (rows,))
        x_pjrt = x.to("pjrt").requires_grad_()
        first, second, third = compiled(x_pjrt, y.to("pjrt"), labels.to("pjrt"))
        (first.sum() + second.sum()).backward()
        x_cpu = x.clone().requires_grad_()
        swished = swish_cpu(x_cpu, 1.5)
        expected = (torch.tanh(swished) * y * 0.5).sum(-1), swished * labels[:, None]
        (expected[0].sum() + expected[1].sum()).backward()
        torch.testing.assert_close(first.cpu(), expected[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(second.cpu(), expected[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x_pjrt.grad.cpu(), x_cpu.grad, rtol=1e-5, atol=1e-5)
        assert tuple(third.shape) == resized_shape(rows, cols)
        torch.testing.assert_close(third.cpu(), torch.full(third.shape, x.reshape(-1)[0].item()))
    assert len(graphs) == 1

    def normed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return pallas_rms_norm.rms_norm(x, weight)

    compiled_norm = torch.compile(normed, backend="pjrt", dynamic=True)
    for rows in (4, 7):
        x, weight = torch.randn(rows, 8), torch.rand(8)
        torch.testing.assert_close(compiled_norm(x.to("pjrt"), weight.to("pjrt")).cpu(), rms_norm_cpu(x, weight),
                                   rtol=1e-5, atol=1e-5)


def test_kernels_see_32_bit_defaults_unless_an_argument_is_64_bit() -> None:
    assert arange_like(torch.randn(3, device="pjrt")).dtype == torch.float32
    wide = arange_like(torch.randn(3, device="pjrt", dtype=torch.float64))
    assert wide.dtype == torch.float64
    torch.testing.assert_close(wide.cpu(), torch.arange(3, dtype=torch.float64) + 1.5)
    first, second = scaled_pair(*(torch.randn(2, 3, dtype=torch.float64, device="pjrt") for _ in range(2)),
                                torch.tensor([3, 4], device="pjrt"), scale=1.0)
    assert (first.dtype, second.dtype) == (torch.float64, torch.float64)


def test_clear_errors_name_the_op() -> None:
    with pytest.raises(ValueError, match="'plain_name' needs a namespace"):
        kernels.jax_op("plain_name", lambda x: x)
    with pytest.raises(TypeError, match="kernels_test::bare's parameter 'x' has no type annotation"):
        kernels.jax_op("kernels_test::bare", lambda x: x)
    with pytest.raises(RuntimeError, match="kernels_test::swish runs on pjrt tensors, but got tensors on cpu"):
        swish(torch.randn(3))

    @kernels.jax_op("kernels_test::nonzero")
    def nonzero(x: jax.Array) -> jax.Array:
        return jnp.nonzero(x)[0]

    with pytest.raises(RuntimeError, match="kernels_test::nonzero's output shapes or control flow depend on"):
        nonzero(torch.randn(4, device="pjrt"))

    @kernels.jax_op("kernels_test::pallas_without_vjp", vjp="auto")
    def pallas_without_vjp(x: jax.Array) -> jax.Array:
        return _pallas_double(x)

    x = torch.randn(8, 4, device="pjrt", requires_grad=True)
    with pytest.raises(RuntimeError, match="jax.vjp cannot differentiate kernels_test::pallas_without_vjp"):
        pallas_without_vjp(x).sum().backward()


def _pallas_double(x: jax.Array) -> jax.Array:
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):  # noqa: ANN001, ANN202
        o_ref[...] = x_ref[...] * 2

    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pl.pallas_call(kernel, out_shape=shape, interpret=kernels.interpret_mode())(x)


def test_compiled_graphs_with_a_kernel_are_stored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_PJRT_CACHE_DIR", str(tmp_path))
    x = torch.randn(4, 3, device="pjrt", requires_grad=True)

    def run() -> tuple[int, ...]:
        torch._dynamo.reset()
        before = torch_pjrt.metrics.counters()
        torch.compile(lambda x: swish(x, 0.3).sin().sum(), backend="pjrt")(x).backward()
        after = torch_pjrt.metrics.counters()
        return tuple(after[name] - before[name] for name in ("disk_store_writes", "disk_store_hits"))

    # the forward and the backward graph, each stored as its traced program and its XLA executable
    assert run() == (4, 0)
    assert run() == (0, 4)


def test_a_kernels_fingerprint_follows_its_source(tmp_path: Path) -> None:
    """Part of a stored graph's key: editing the kernel's file makes a later process retrace."""
    def fingerprint(source: str, module: str) -> str:
        path = tmp_path / f"{module}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(module, path)
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        return jax_ops._fingerprint(functools.partial(loaded.kernel, scale=2))

    source = "def kernel(x, scale):\n    return x * scale\n"
    first = fingerprint(source, "kernel_a")
    assert fingerprint(source, "kernel_b") == first
    assert fingerprint(source.replace("x * scale", "x + scale"), "kernel_c") != first


# --- flash attention and the SDPA switch -----------------------------------------------------------

ATTENTION_CASES = [  # (q shape, k/v shape, causal): whole blocks; uneven self-attention; uneven cross-attention
    ((1, 2, 64, 32), (1, 2, 64, 32), True),
    ((1, 2, 50, 16), (1, 2, 50, 16), True),
    ((1, 2, 7, 16), (1, 2, 37, 16), False),
]
FLASH, FLASH_VJP = "torch_pjrt.flash_attention.default", "torch_pjrt.flash_attention_vjp.default"


def attention_inputs(q_shape: tuple[int, ...], kv_shape: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.randn(q_shape), torch.randn(kv_shape), torch.randn(kv_shape)]


@pytest.mark.parametrize(("q_shape", "kv_shape", "causal"), ATTENTION_CASES[::2])  # [1]: the training test
def test_flash_attention_matches_sdpa_on_cpu(q_shape: tuple, kv_shape: tuple, causal: bool) -> None:
    inputs, grad = attention_inputs(q_shape, kv_shape), torch.randn(q_shape)
    expected_leaves = leaves(*inputs, device="cpu")
    expected = torch.nn.functional.scaled_dot_product_attention(*expected_leaves, is_causal=causal)
    expected.backward(grad)
    actual_leaves = leaves(*inputs, device="pjrt")
    actual = kernels.flash_attention(*actual_leaves, causal=causal)
    actual.backward(grad.to("pjrt"))
    torch.testing.assert_close(actual.detach().cpu(), expected.detach(), rtol=1e-5, atol=1e-5)
    for a, e in zip(actual_leaves, expected_leaves):
        torch.testing.assert_close(a.grad.cpu(), e.grad, rtol=1e-4, atol=1e-5)


def test_sdpa_switch_takes_the_kernel_where_it_applies() -> None:
    q, k, v = attention_inputs(*ATTENTION_CASES[0][:2])
    mask = torch.rand(64, 64) > 0.3
    on_device = [t.to("pjrt") for t in (q, k, v)]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    before = torch_pjrt.metrics.counters()["ops_executed"]
    with kernels.use_flash_attention():
        calls = op_counts[FLASH]
        causal = sdpa(*on_device, is_causal=True)
        assert op_counts[FLASH] == calls + 1
        masked = sdpa(*on_device, attn_mask=mask.to("pjrt"))  # a mask: PyTorch's own decomposition
        assert op_counts[FLASH] == calls + 1
    torch.testing.assert_close(causal.cpu(), sdpa(q, k, v, is_causal=True), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(masked.cpu(), sdpa(q, k, v, attn_mask=mask), rtol=1e-5, atol=1e-5)
    assert torch_pjrt.metrics.counters()["ops_executed"] > before
    sdpa(*on_device, is_causal=True)  # switched off again
    assert op_counts[FLASH] == calls + 1


def test_flash_attention_in_fused_and_compiled_training() -> None:
    """Fused eager through the SDPA switch; compiled, the op called by name inside the graph."""
    inputs, grad = attention_inputs(*ATTENTION_CASES[1][:2]), torch.randn(ATTENTION_CASES[1][0])

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True) * grad).sum()

    def flash_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        return (kernels.flash_attention(q, k, v, causal=True) * grad).sum()

    expected_leaves = leaves(*inputs, device="cpu")
    step(*expected_leaves, grad).backward()
    compiled = torch.compile(flash_step, backend="pjrt", fullgraph=True)
    for run in (step, compiled):
        actual_leaves = leaves(*inputs, device="pjrt")
        calls = op_counts[FLASH] + op_counts[FLASH_VJP]
        with kernels.use_flash_attention(), torch.pjrt.set_eager_mode(FUSE):
            run(*actual_leaves, grad.to("pjrt")).backward()
            grads = [t.grad.cpu() for t in actual_leaves]
        # eager runs the forward and its vjp as ops; compiled, they are nodes inside the graphs' programs
        assert op_counts[FLASH] + op_counts[FLASH_VJP] == calls + (2 if run is step else 0)
        for a, e in zip(grads, expected_leaves):
            torch.testing.assert_close(a, e.grad, rtol=1e-4, atol=1e-5)


def test_a_hugging_face_llama_uses_the_kernel_unchanged() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).eval()
    tokens = torch.randint(0, 64, (2, 24))
    expected = model(tokens).logits
    model.to("pjrt")
    calls = op_counts[FLASH]
    with torch.no_grad(), kernels.use_flash_attention():
        actual = model(tokens.to("pjrt")).logits.cpu()
    assert op_counts[FLASH] == calls + 1
    torch.testing.assert_close(actual, expected.detach(), rtol=1e-4, atol=1e-4)


def test_flash_attention_opcheck_and_errors() -> None:
    q, k, v = (t.to("pjrt") for t in attention_inputs(*ATTENTION_CASES[1][:2]))
    # (AOTAutograd over it: test_sdpa_switch_in_fused_and_compiled_training)
    assert kernels.opcheck(kernels.flash_attention, (q.requires_grad_(), k, v), {"causal": True}) == dict.fromkeys(
        kernels.op_checks.DEFAULT_TEST_UTILS, "SUCCESS")
    with pytest.raises(ValueError, match="flash_attention: q, k and v must share one of float32"):
        kernels.flash_attention(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="causal attention needs at least as many keys as queries"):
        kernels.flash_attention(q, k[:, :, :10], v[:, :, :10], causal=True)


def test_the_environment_variable_switches_sdpa_for_the_whole_process() -> None:
    script = ("import torch\n"
              "from torch_pjrt.runtime.metrics import op_counts\n"
              "q = torch.randn(1, 2, 32, 16, device='pjrt')\n"
              "torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).cpu()\n"
              f"print(op_counts['{FLASH}'])\n")
    env = {**os.environ, "TORCH_PJRT_FLASH_ATTENTION": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1"]


def test_a_donated_argument_gives_its_buffer_to_the_result_and_is_consumed() -> None:
    total, x = torch.randn(64, 32), torch.randn(64, 32)
    for _ in range(2):  # the first call builds the program, the second replays it
        on_device = total.to("pjrt")
        buffer = storage.storage_of(on_device).array
        got = accumulate(on_device, x.to("pjrt"))
        torch.testing.assert_close(got.cpu(), total + x * 2)
        assert buffer.is_deleted()  # the donated buffer went to the program
        with pytest.raises(RuntimeError, match="donated to kernels_test::accumulate"):
            on_device.cpu()
        with pytest.raises(RuntimeError, match="donated to kernels_test::accumulate"):
            on_device + 1


def test_nothing_is_donated_where_the_argument_must_stay_readable() -> None:
    total, x = torch.randn(8, 4), torch.randn(8, 4)
    want = total + x * 2
    with torch.pjrt.set_eager_mode(FUSE):  # the fused program reuses buffers itself
        on_device = total.to("pjrt")
        got = accumulate(on_device, x.to("pjrt"))
        torch.testing.assert_close(got.cpu(), want)
        torch.testing.assert_close(on_device.cpu(), total)
    # autograd keeps the inputs of a derived backward (which reruns the forward)
    leaf = total.to("pjrt").requires_grad_()
    got = accumulate(leaf, x.to("pjrt"))
    got.sum().backward()
    torch.testing.assert_close(got.detach().cpu(), want)
    torch.testing.assert_close(leaf.grad.cpu(), torch.ones(8, 4))
    torch.testing.assert_close(leaf.detach().cpu(), total)


# --- paged_attention ---------------------------------------------------------------------------

PAGED = dict(layers=2, blocks=12, kv_heads=2, block_size=16, head_size=32, heads=4, pages=4)


def paged_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A 2-layer paged cache of random rows, and query tokens whose block tables name random pages (one
    sharing a page with another, as a prefix-cached request does) and who see 1..all of their positions."""
    p = PAGED
    cache = torch.randn(p["layers"], p["blocks"], p["kv_heads"], p["block_size"], 2 * p["head_size"]).to(dtype)
    lengths = torch.tensor([1, 17, 33, p["pages"] * p["block_size"], 40, 2])
    tables = torch.stack([torch.randperm(p["blocks"] - 1)[: p["pages"]] + 1 for _ in lengths])
    tables[1, 0] = tables[0, 0]
    query = torch.randn(len(lengths), p["heads"], p["head_size"]).to(dtype)
    return query, cache, tables, lengths


def paged_attention_cpu(query: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                        layer: int, scale: float, soft_cap: float) -> torch.Tensor:
    """Each token's context gathered from its pages, then softmax attention in float32 (grouped heads)."""
    p = PAGED
    out = []
    for q, table, length in zip(query.float(), tables, lengths):
        rows = cache[layer][table].float().permute(1, 0, 2, 3).reshape(p["kv_heads"], -1, 2 * p["head_size"])
        keys, values = (rows[:, :length, half].repeat_interleave(p["heads"] // p["kv_heads"], 0)
                        for half in (slice(None, p["head_size"]), slice(p["head_size"], None)))
        scores = torch.einsum("hd,hsd->hs", q, keys) * scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        out.append(torch.einsum("hs,hsd->hd", scores.softmax(-1), values))
    return torch.stack(out).to(query.dtype)


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize(("dtype", "layer", "soft_cap"), [(torch.float32, 1, 0.0), (torch.float32, 0, 5.0),
                                                          (torch.bfloat16, 1, 0.0)])
def test_paged_attention_matches_attention_over_the_gathered_context(mode: str, dtype: torch.dtype, layer: int,
                                                                     soft_cap: float) -> None:
    query, cache, tables, lengths = paged_inputs(dtype)
    expected = paged_attention_cpu(query, cache, tables, lengths, layer, 0.2, soft_cap)
    with torch.pjrt.set_eager_mode(FUSE if mode == "fused" else torch_pjrt.EagerMode.DEFER_NEVER):
        on_device = (t.to("pjrt") for t in (query, cache, tables, lengths))
        actual = kernels.paged_attention(*on_device, layer=layer, scale=0.2, soft_cap=soft_cap).cpu()
    tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(actual, expected, **tolerance)


@pytest.mark.parametrize("whole_buffer", [False, True])
def test_gathered_attention_matches_attention_over_the_gathered_context(whole_buffer: bool) -> None:
    """The torch-op attention over one layer's cache, or over the whole buffer given the layer's index."""
    from torch_pjrt.kernels import paged

    query, cache, tables, lengths = paged_inputs(torch.float32)
    layer, p = 1, PAGED
    expected = paged_attention_cpu(query, cache, tables, lengths, layer, 0.2, 5.0)
    positions = torch.arange(p["pages"] * p["block_size"])
    visible = positions[None, :] < lengths[:, None]
    on_device = [t.to("pjrt") for t in (query, cache if whole_buffer else cache[layer], tables, visible)]
    index = torch.tensor([layer], device="pjrt") if whole_buffer else None
    actual = paged.gathered_attention(*on_device, scale=0.2, soft_cap=5.0, layer=index).cpu()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_paged_attention_opcheck_and_errors() -> None:
    query, cache, tables, lengths = (t.to("pjrt") for t in paged_inputs(torch.float32))
    keywords = {"layer": 1, "scale": 0.2}
    # an inference kernel: no backward, so no autograd registration to check
    tests = tuple(t for t in kernels.op_checks.DEFAULT_TEST_UTILS if t != "test_autograd_registration")
    assert kernels.opcheck(kernels.paged_attention, (query, cache, tables, lengths), keywords,
                           test_utils=tests) == dict.fromkeys(tests, "SUCCESS")
    with pytest.raises(ValueError, match="paged_attention: the cache's rows must hold a key and a value of head_size"):
        kernels.paged_attention(query[..., :16], cache, tables, lengths, **keywords)
    with pytest.raises(ValueError, match="paged_attention: layer 2 is not one of the cache's 2 layers"):
        kernels.paged_attention(query, cache, tables, lengths, layer=2, scale=0.2)
    with pytest.raises(ValueError, match=r"block_tables and lengths need a row per query token \(6\)"):
        kernels.paged_attention(query, cache, tables[:3], lengths, **keywords)

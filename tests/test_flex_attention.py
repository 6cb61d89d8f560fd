"""Eager FlexAttention on pjrt: values against CPU's FlexAttention, gradients against CPU's math SDPA with
the equivalent float mask (CPU's FlexAttention has no backward)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

import torch_pjrt

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

BATCH, HEADS, LENGTH, DIM = 2, 4, 256, 16  # 256 positions: two of the block mask's 128-wide blocks
WINDOW = 40
MODES = {"strict": torch_pjrt.EagerMode.DEFER_NEVER, "fused": torch_pjrt.EagerMode.DEFER_AND_FUSE}


def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return q_idx >= kv_idx


def sliding_window(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)


def relative_bias(score: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
    return score + (q_idx - kv_idx) * 0.05 * (h + 1)


def positions() -> tuple[torch.Tensor, torch.Tensor]:
    index = torch.arange(LENGTH)
    return index[:, None], index[None, :]


def float_mask(mask_mod: Callable[..., Any] | None, score_mod: Callable[..., Any] | None) -> torch.Tensor:
    """The additive [HEADS, LENGTH, LENGTH] mask that SDPA needs to compute what flex_attention does."""
    q_idx, kv_idx = positions()
    heads = torch.arange(HEADS)[:, None, None]
    mask = torch.zeros(HEADS, LENGTH, LENGTH)
    if score_mod is not None:
        mask = score_mod(mask, None, heads, q_idx, kv_idx)
    if mask_mod is not None:
        mask = mask.masked_fill(~mask_mod(None, heads, q_idx, kv_idx), float("-inf"))
    return mask


def random_inputs(kv_heads: int = HEADS) -> list[torch.Tensor]:
    return [torch.randn(BATCH, HEADS, LENGTH, DIM), torch.randn(BATCH, kv_heads, LENGTH, DIM),
            torch.randn(BATCH, kv_heads, LENGTH, DIM)]


def on_pjrt(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.to("pjrt").requires_grad_() for t in tensors]


CASES = {
    "plain": (None, None),
    "relative_bias": (None, relative_bias),
    "causal": (causal, None),
    "sliding_window_with_bias": (sliding_window, relative_bias),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_values_and_gradients_match_cpu(case: str, mode: str) -> None:
    mask_mod, score_mod = CASES[case]
    inputs, grad = random_inputs(), torch.randn(BATCH, HEADS, LENGTH, DIM)
    cpu_mask = None if mask_mod is None else create_block_mask(mask_mod, None, None, LENGTH, LENGTH, device="cpu")
    expected_out = flex_attention(*inputs, score_mod=score_mod, block_mask=cpu_mask)

    cpu_inputs = [t.clone().requires_grad_() for t in inputs]
    with sdpa_kernel(SDPBackend.MATH):
        sdpa_out = torch.nn.functional.scaled_dot_product_attention(
            *cpu_inputs, attn_mask=float_mask(mask_mod, score_mod))
    torch.testing.assert_close(sdpa_out.detach(), expected_out, rtol=1e-5, atol=1e-5)  # the mask is equivalent
    (sdpa_out * grad).sum().backward()

    with torch.pjrt.set_eager_mode(MODES[mode]):
        device_inputs = on_pjrt(inputs)
        block_mask = None if mask_mod is None else create_block_mask(
            mask_mod, None, None, LENGTH, LENGTH, device="pjrt")
        out = flex_attention(*device_inputs, score_mod=score_mod, block_mask=block_mask)
        (out * grad.to("pjrt")).sum().backward()
        actual_out = out.detach().cpu()
        actual_grads = [t.grad.cpu() for t in device_inputs]
    torch.testing.assert_close(actual_out, expected_out, rtol=1e-5, atol=1e-5)
    for actual, expected in zip(actual_grads, cpu_inputs):
        torch.testing.assert_close(actual, expected.grad, rtol=1e-4, atol=1e-5)


def test_grouped_query_attention_with_a_block_mask() -> None:
    inputs, grad = random_inputs(kv_heads=2), torch.randn(BATCH, HEADS, LENGTH, DIM)
    cpu_inputs = [t.clone().requires_grad_() for t in inputs]
    with sdpa_kernel(SDPBackend.MATH):
        expected = torch.nn.functional.scaled_dot_product_attention(
            *cpu_inputs, attn_mask=float_mask(sliding_window, None), enable_gqa=True)
    (expected * grad).sum().backward()

    device_inputs = on_pjrt(inputs)
    block_mask = create_block_mask(sliding_window, BATCH, HEADS, LENGTH, LENGTH, device="pjrt")
    out = flex_attention(*device_inputs, block_mask=block_mask, enable_gqa=True)
    (out * grad.to("pjrt")).sum().backward()
    torch.testing.assert_close(out.detach().cpu(), expected.detach(), rtol=1e-5, atol=1e-5)
    for actual, expected_input in zip(device_inputs, cpu_inputs):
        torch.testing.assert_close(actual.grad.cpu(), expected_input.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("request_lse", [{"return_lse": True}, {"return_aux": AuxRequest(lse=True)}],
                         ids=["return_lse", "return_aux"])
@pytest.mark.filterwarnings("ignore:return_lse is deprecated")
def test_log_sum_exp_is_returned_with_the_output(request_lse: dict[str, Any]) -> None:
    inputs = random_inputs()
    block_mask = create_block_mask(causal, None, None, LENGTH, LENGTH, device="pjrt")
    out, aux = flex_attention(*[t.to("pjrt") for t in inputs], score_mod=relative_bias, block_mask=block_mask,
                              **request_lse)
    lse = aux.lse if "return_aux" in request_lse else aux
    query, key, _ = inputs
    scores = query @ key.transpose(-2, -1) / DIM**0.5 + float_mask(causal, relative_bias)
    torch.testing.assert_close(lse.cpu(), torch.logsumexp(scores, dim=-1), rtol=1e-5, atol=1e-5)
    expected_out = flex_attention(*inputs, score_mod=relative_bias,
                                  block_mask=create_block_mask(causal, None, None, LENGTH, LENGTH, device="cpu"))
    torch.testing.assert_close(out.cpu(), expected_out, rtol=1e-5, atol=1e-5)


def test_a_learned_bias_captured_by_the_score_mod_gets_its_gradient() -> None:
    inputs, grad, table = random_inputs(), torch.randn(BATCH, HEADS, LENGTH, DIM), torch.randn(HEADS, 2 * LENGTH - 1)
    q_idx, kv_idx = positions()
    cpu_inputs, cpu_table = [t.clone().requires_grad_() for t in inputs], table.clone().requires_grad_()
    with sdpa_kernel(SDPBackend.MATH):
        expected = torch.nn.functional.scaled_dot_product_attention(
            *cpu_inputs, attn_mask=cpu_table[:, q_idx - kv_idx + LENGTH - 1])
    (expected * grad).sum().backward()

    device_table = table.to("pjrt").requires_grad_()

    def learned_bias(score: torch.Tensor, b: Any, h: Any, q: Any, kv: Any) -> torch.Tensor:
        return score + device_table[h, q - kv + LENGTH - 1]

    device_inputs = on_pjrt(inputs)
    out = flex_attention(*device_inputs, score_mod=learned_bias)
    (out * grad.to("pjrt")).sum().backward()
    torch.testing.assert_close(out.detach().cpu(), expected.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(device_table.grad.cpu(), cpu_table.grad, rtol=1e-4, atol=1e-4)
    for actual, expected_input in zip(device_inputs, cpu_inputs):
        torch.testing.assert_close(actual.grad.cpu(), expected_input.grad, rtol=1e-4, atol=1e-5)


def test_other_devices_keep_pytorchs_check() -> None:
    torch.empty(1, device="pjrt")  # the device has started, so the check is installed
    query, key, value = [t.requires_grad_() for t in random_inputs()]
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_attention(query, key, value)


@pytest.mark.parametrize("case", ["sliding_window_with_bias", "relative_bias"])
def test_compiled_model_with_flex_attention_matches_cpu(case: str) -> None:
    """Inside a compiled graph (backend pjrt, one graph) the device check is traced, not a frame Dynamo skips;
    with no block mask, flex_attention's default mask function (made on the model's device) lowers too."""
    from torch_pjrt import _torch_private

    mask_mod, score_mod = CASES[case]

    torch.empty(1, device="pjrt")
    _torch_private.dynamo_skip_our_packages()  # torch_pjrt's frames are skipped, as after any pjrt compile
    projection, inputs, grad = torch.nn.Linear(DIM, DIM), random_inputs(), torch.randn(BATCH, HEADS, LENGTH, DIM)

    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: torch.nn.Module,
               block_mask: Any) -> torch.Tensor:
        return flex_attention(layer(query), key, value, score_mod=score_mod, block_mask=block_mask)

    cpu_inputs = [t.clone().requires_grad_() for t in inputs]
    with sdpa_kernel(SDPBackend.MATH):
        expected = torch.nn.functional.scaled_dot_product_attention(
            projection(cpu_inputs[0]), *cpu_inputs[1:], attn_mask=float_mask(mask_mod, score_mod))
    (expected * grad).sum().backward()

    device_projection, device_inputs = torch.nn.Linear(DIM, DIM).to("pjrt"), on_pjrt(inputs)
    device_projection.load_state_dict(projection.state_dict())
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, None, None, LENGTH, LENGTH, device="pjrt")
    torch._dynamo.reset()
    out = torch.compile(attend, backend="pjrt", fullgraph=True)(*device_inputs, device_projection, block_mask)
    (out * grad.to("pjrt")).sum().backward()
    torch.testing.assert_close(out.detach().cpu(), expected.detach(), rtol=1e-5, atol=1e-5)
    for actual, expected_input in zip(device_inputs, cpu_inputs):
        torch.testing.assert_close(actual.grad.cpu(), expected_input.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(device_projection.weight.grad.cpu(), projection.weight.grad, rtol=1e-4, atol=1e-4)


def test_cpu_references_get_flex_attentions_gradients() -> None:
    """The zoo's CPU reference of a model with FlexAttention differentiates it (PyTorch's check alone refuses)."""
    from torch_pjrt import _torch_private

    torch.empty(1, device="pjrt")
    inputs, grad = random_inputs(), torch.randn(BATCH, HEADS, LENGTH, DIM)
    flex_inputs, sdpa_inputs = ([t.clone().requires_grad_() for t in inputs] for _ in range(2))
    with _torch_private.flex_attention_backward_on_cpu():
        block_mask = create_block_mask(sliding_window, None, None, LENGTH, LENGTH, device="cpu")
        (flex_attention(*flex_inputs, score_mod=relative_bias, block_mask=block_mask) * grad).sum().backward()
    with sdpa_kernel(SDPBackend.MATH):
        expected = torch.nn.functional.scaled_dot_product_attention(
            *sdpa_inputs, attn_mask=float_mask(sliding_window, relative_bias))
    (expected * grad).sum().backward()
    for actual, expected_input in zip(flex_inputs, sdpa_inputs):
        torch.testing.assert_close(actual.grad, expected_input.grad, rtol=1e-4, atol=1e-5)
    with pytest.raises(NotImplementedError, match="backward on CPU"):  # PyTorch's check is back
        flex_attention(*flex_inputs)
    flex_attention(*on_pjrt(inputs))  # pjrt still accepted

"""torchao on pjrt: int8 quantization, float8 weight-only, float8 training and the MX block formats against CPU.

Runs in .venv-libs (`make test-libs`); skipped where torchao is not installed.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

torchao = pytest.importorskip("torchao")

from torchao.float8 import convert_to_float8_training  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx  # noqa: E402
from torchao.quantization import (  # noqa: E402
    Float8DynamicActivationFloat8WeightConfig,
    Float8WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    quantize_,
)


def linear_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))


def same_bytes(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    assert actual.device.type == "pjrt" and actual.dtype == expected.dtype and actual.shape == expected.shape
    return torch.equal(actual.cpu().view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("config", [Int8WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig,
                                    Float8WeightOnlyConfig])
def test_quantize_matches_cpu(config: Any) -> None:
    model = linear_model()
    on_pjrt = copy.deepcopy(model).to("pjrt")
    quantize_(model, config())
    quantize_(on_pjrt, config())
    for quantized, reference in ((on_pjrt[0], model[0]), (on_pjrt[2], model[2])):
        weight, expected = quantized.weight, reference.weight
        assert type(weight) is type(expected) and type(expected).__name__ != "Parameter"
        for name in expected.tensor_data_names:  # the quantized values and their scales, byte for byte
            assert same_bytes(getattr(weight, name), getattr(expected, name)), name
    inputs = torch.randn(16, 64)
    torch.testing.assert_close(on_pjrt(inputs.to("pjrt")).cpu(), model(inputs))


def test_cuda_only_configuration_refused_as_on_cpu() -> None:
    """torchao's float8 dynamic quantization needs CUDA (sm89+), MI300 or XPU: the same refusal on pjrt as on CPU."""
    for device in ("cpu", "pjrt"):
        with pytest.raises(AssertionError, match="requires CUDA compute capability"):
            quantize_(linear_model().to(device), Float8DynamicActivationFloat8WeightConfig())


def test_float8_training_matches_cpu() -> None:
    model = linear_model()
    on_pjrt = copy.deepcopy(model).to("pjrt")
    convert_to_float8_training(model)
    convert_to_float8_training(on_pjrt)
    assert isinstance(on_pjrt[0], Float8Linear) and isinstance(on_pjrt[2], Float8Linear)
    losses: dict[str, list[torch.Tensor]] = {"cpu": [], "pjrt": []}
    for net, device in ((model, "cpu"), (on_pjrt, "pjrt")):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
        generator = torch.Generator().manual_seed(3)
        for _ in range(3):
            inputs, targets = torch.randn(16, 64, generator=generator), torch.randn(16, 32, generator=generator)
            loss = torch.nn.functional.mse_loss(net(inputs.to(device)), targets.to(device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[device].append(loss.detach().cpu())
    torch.testing.assert_close(losses["pjrt"], losses["cpu"], rtol=1e-5, atol=1e-6)
    for trained, reference in zip(on_pjrt.parameters(), model.parameters()):
        torch.testing.assert_close(trained.cpu(), reference, rtol=1e-5, atol=1e-6)


MX_ELEMENTS = [torch.float8_e4m3fn, torch.float8_e5m2, "fp6_e2m3", "fp6_e3m2", torch.float4_e2m1fn_x2]


@pytest.mark.parametrize("element", MX_ELEMENTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mx_block_casts_bit_for_bit(element: Any, dtype: torch.dtype) -> None:
    """torchao's MX formats: blocks of 32 with one e8m0 scale each, elements in float8, fp6 or fp4 (packed)."""
    blocks = torch.randn(64, 8, 32, dtype=torch.float64)
    magnitudes = 10.0 ** torch.randint(-20, 20, (64, 8, 1)).double()  # block scales over 40 decades
    values = (blocks * magnitudes).reshape(64, 256).to(dtype)
    values[0, :32] = 0  # an all-zero block
    scale, data = to_mx(values, element, 32)
    scale_pjrt, data_pjrt = to_mx(values.to("pjrt"), element, 32)
    assert same_bytes(scale_pjrt, scale) and same_bytes(data_pjrt, data)
    if element is torch.float4_e2m1fn_x2:  # torchao packs fp4 pairs in uint8; NVFP4's matmuls view them as fp4
        assert same_bytes(data_pjrt.view(element), data.view(element))
    restored = to_dtype(data, scale, element, 32, dtype)
    restored_pjrt = to_dtype(data_pjrt, scale_pjrt, element, 32, dtype)
    assert same_bytes(restored_pjrt, restored)

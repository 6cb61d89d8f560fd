"""PyTorch Lightning on pjrt: `Trainer(accelerator="pjrt")` with no other line of the user's code.

Lightning finds accelerators in its AcceleratorRegistry, filled when `pytorch_lightning.accelerators`
loads: the pjrt accelerator is registered there as that module finishes loading. Two of the
Trainer's automatic choices name CUDA or the CPU for every accelerator but its own: one device gets a
SingleDeviceStrategy on "cpu", and `precision="16-mixed"`/`"bf16-mixed"` autocasts on "cuda". For the
pjrt accelerator they get the pjrt device instead. Several devices get Lightning's own DDP strategy,
whose process group backend for pjrt devices is the c10d backend "pjrt" (torch.distributed's map of
device types to backends); it wraps the model on a CUDA side stream whenever it passes DDP device ids,
so on pjrt it passes none (DDP needs none for a module on one device).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from torch_pjrt.runtime.startup import NAME


def _parse_indices(devices: Any) -> list[int]:
    """Lightning's `devices=`: a count (-1: all), a list of indices, or a string of either ("2", "0,1", "-1")."""
    count = torch.pjrt.device_count()
    if isinstance(devices, str):
        text = devices.strip()
        devices = [int(part) for part in text.split(",") if part.strip()] if "," in text else int(text)
    if isinstance(devices, int):
        if devices == -1:
            return list(range(count))
        if not 0 < devices <= count:
            raise ValueError(f"devices={devices} asks for {devices} pjrt device(s) but {count} exist: pass at most "
                             f"{count} (set TORCH_PJRT_CPU_DEVICES=N for more CPU devices).")
        return list(range(devices))
    indices = [int(index) for index in devices]
    missing = [index for index in indices if not 0 <= index < count]
    if missing or not indices:
        raise ValueError(f"devices={list(devices)} names pjrt device(s) {missing or 'none'} but the indices are "
                         f"0..{count - 1}: pass existing indices.")
    return indices


def _accelerator_class(base: type) -> type:
    class PjrtAccelerator(base):
        """Lightning's Accelerator for pjrt devices (registered as "pjrt")."""

        def setup_device(self, device: torch.device) -> None:
            if device.type != NAME:
                raise ValueError(f"The pjrt accelerator was given the device {device}: pass a pjrt device.")
            torch.pjrt.set_device(device)

        def get_device_stats(self, device: Any) -> dict[str, Any]:
            return torch.pjrt.memory_stats(device)

        def teardown(self) -> None:
            """Nothing to release: device memory belongs to the tensors."""

        @staticmethod
        def parse_devices(devices: Any) -> list[int]:
            return _parse_indices(devices)

        @staticmethod
        def get_parallel_devices(devices: Any) -> list[torch.device]:
            return [torch.device(NAME, index) for index in _parse_indices(devices)]

        @staticmethod
        def auto_device_count() -> int:
            return torch.pjrt.device_count()

        @staticmethod
        def is_available() -> bool:
            return torch.pjrt.is_available()

        @staticmethod
        def name() -> str:
            return NAME

        @classmethod
        def register_accelerators(cls, accelerator_registry: Any) -> None:
            accelerator_registry.register(NAME, cls, description=cls.__name__)

    return PjrtAccelerator


def register_accelerator(module: Any) -> None:
    """`pytorch_lightning.accelerators` has loaded: add "pjrt" to its AcceleratorRegistry."""
    if NAME in module.AcceleratorRegistry:
        return
    accelerator = _accelerator_class(module.Accelerator)
    module.PjrtAccelerator = accelerator
    accelerator.register_accelerators(module.AcceleratorRegistry)


def _on_pjrt(connector: Any) -> bool:
    accelerator = getattr(connector, "accelerator", None)
    return accelerator is not None and type(accelerator).__name__ == "PjrtAccelerator"


def patch_connector(module: Any) -> None:
    """The Trainer's automatic strategy and mixed precision for the pjrt accelerator use the pjrt device."""
    connector = module._AcceleratorConnector
    original_strategy = connector._choose_strategy
    if getattr(original_strategy, "_pjrt_aware", False):
        return
    original_precision = connector._check_and_init_precision

    @functools.wraps(original_strategy)
    def _choose_strategy(self: Any) -> Any:
        chosen = original_strategy(self)
        if (_on_pjrt(self) and isinstance(chosen, module.SingleDeviceStrategy) and self._parallel_devices
                and chosen.root_device.type == "cpu"):
            return module.SingleDeviceStrategy(device=self._parallel_devices[0])
        return chosen

    @functools.wraps(original_precision)
    def _check_and_init_precision(self: Any) -> Any:
        with warnings.catch_warnings():
            if _on_pjrt(self):
                # Lightning builds a CUDA GradScaler for "16-mixed" first; it is replaced below.
                warnings.filterwarnings("ignore", ".*CUDA is not available.*")
            precision = original_precision(self)
        if _on_pjrt(self) and isinstance(precision, module.MixedPrecision) and precision.device == "cuda":
            return module.MixedPrecision(precision.precision, NAME)
        return precision

    _choose_strategy._pjrt_aware = True
    connector._choose_strategy = _choose_strategy
    connector._check_and_init_precision = _check_and_init_precision


def patch_ddp(module: Any) -> None:
    """Lightning's DDPStrategy on a pjrt device: no device ids, so no CUDA stream around the DDP wrap."""
    strategy = module.DDPStrategy
    original = strategy.determine_ddp_device_ids
    if getattr(original, "_pjrt_aware", False):
        return

    @functools.wraps(original)
    def determine_ddp_device_ids(self: Any) -> list[int] | None:
        return None if self.root_device.type == NAME else original(self)

    determine_ddp_device_ids._pjrt_aware = True
    strategy.determine_ddp_device_ids = determine_ddp_device_ids

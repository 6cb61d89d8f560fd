"""The PJRT runtime through jaxlib: devices, transfers, programs and counters."""

from torch_pjrt.runtime.client import (
    device_for,
    devices,
    platform,
    synchronize,
    to_device,
    to_host,
)
from torch_pjrt.runtime.metrics import counters

__all__ = ["counters", "device_for", "devices", "platform", "synchronize", "to_device", "to_host"]

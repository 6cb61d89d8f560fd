"""torch_pjrt: a native PyTorch device, "pjrt", for every accelerator XLA's runtime drives.

`import torch` is enough (autoload); importing this package also registers the device.
"""

from __future__ import annotations

from typing import Any

from torch_pjrt._registration import register

__version__ = "0.1.0"

register()

_LAZY = {
    "metrics": ("torch_pjrt.metrics", None),
    "kernels": ("torch_pjrt.kernels", None),
    "cpu_fallback": ("torch_pjrt.eager.fallback", "cpu_fallback"),
    "EagerMode": ("torch_pjrt.eager.modes", "EagerMode"),
    "set_eager_mode": ("torch_pjrt.eager.modes", "set_eager_mode"),
    "export_stablehlo": ("torch_pjrt.compile.export", "export_stablehlo"),
    "mark_dynamic": ("torch_pjrt.eager.dynamic", "mark_dynamic"),
    "get_dynamism_info": ("torch_pjrt.eager.dynamic", "get_dynamism_info"),
    "warmup": ("torch_pjrt.compile.warmup", "warmup"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'torch_pjrt' has no attribute {name!r}")
    import importlib

    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    return module if attribute is None else getattr(module, attribute)


__all__ = [
    "EagerMode", "cpu_fallback", "export_stablehlo", "get_dynamism_info", "kernels", "mark_dynamic", "metrics",
    "register", "set_eager_mode", "warmup",
]

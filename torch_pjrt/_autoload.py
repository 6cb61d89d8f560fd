"""Entry point for PyTorch's device autoload (group "torch.backends"); must never raise."""

import sys
import warnings


def autoload() -> None:
    registration = sys.modules.get("torch_pjrt._registration")
    if registration is not None and not hasattr(registration, "register"):
        return  # `import torch_pjrt` is importing torch: the package registers itself once torch is loaded
    try:
        from torch_pjrt._registration import register

        register()
    except Exception as error:  # noqa: BLE001 (an exception here would break `import torch`)
        warnings.warn(f"torch_pjrt could not register the pjrt device: {error!r}", stacklevel=2)

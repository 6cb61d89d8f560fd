"""Entry point for PyTorch's device autoload (group "torch.backends"); must never raise."""

import warnings


def autoload() -> None:
    try:
        from torch_pjrt import register

        register()
    except Exception as error:  # noqa: BLE001 (an exception here would break `import torch`)
        warnings.warn(f"torch_pjrt could not register the pjrt device: {error!r}", stacklevel=2)

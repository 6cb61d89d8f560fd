"""The _foreach_* family (optimizers' multi-tensor ops), one program per call."""

from __future__ import annotations

import torch

from torch_pjrt.ops.registry import register  # noqa: F401

aten = torch.ops.aten

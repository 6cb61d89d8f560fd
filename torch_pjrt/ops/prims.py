"""PyTorch prims (torch._prims), the targets of the torch._refs decompositions."""

from __future__ import annotations

import torch

from torch_pjrt.ops.registry import register  # noqa: F401

aten = torch.ops.aten

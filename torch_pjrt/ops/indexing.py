"""gather/scatter/index_*/masked_*/index.Tensor/index_put, and friends."""

from __future__ import annotations

import torch

from torch_pjrt.ops.registry import register  # noqa: F401

aten = torch.ops.aten

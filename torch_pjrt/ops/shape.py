"""Shape ops that copy: cat, stack, flip, roll, tril/triu, repeat, pad, and friends."""

from __future__ import annotations

import torch

from torch_pjrt.ops.registry import register  # noqa: F401

aten = torch.ops.aten

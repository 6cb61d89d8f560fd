"""Reductions and scans: sum/mean/prod/var/std/norm, max/min/arg*, any/all, cumsum/cumprod, softmax."""

from __future__ import annotations

import torch

from torch_pjrt.ops.registry import register  # noqa: F401

aten = torch.ops.aten

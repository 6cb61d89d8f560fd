"""Tensor factories: arange, linspace, logspace, eye, full, *_like, scalar_tensor, tril_indices."""

from __future__ import annotations

import torch

from torch_pjrt.ops.registry import register  # noqa: F401

aten = torch.ops.aten

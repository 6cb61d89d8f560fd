"""Elementwise math, comparisons, logic, bitwise ops, where/clamp/lerp, special functions."""

from __future__ import annotations

import torch

from torch_pjrt.ops.registry import register  # noqa: F401

aten = torch.ops.aten

"""Random ops: every lowering takes `rng`, a jax PRNG key derived from the device's seed and counter."""

from __future__ import annotations

import torch

from torch_pjrt.ops.registry import register  # noqa: F401

aten = torch.ops.aten

"""Ops whose output shape depends on values (nonzero, masked_select, unique, ...).

Each waits for its input, reads the size it needs to the host, then runs a program of
static shape. The cost: one device-to-host sync per call.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten

KERNELS: dict[Any, Any] = {}

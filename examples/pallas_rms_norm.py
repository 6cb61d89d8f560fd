"""A fused RMSNorm written in Pallas, used as a PyTorch op in a model and trained on pjrt.

The forward and the backward are each one Pallas kernel wrapped with torch_pjrt.kernels.jax_op;
register_autograd joins them. The same model trains on CPU with PyTorch's own RMSNorm and the
losses are printed side by side.

    python examples/pallas_rms_norm.py --steps 20
"""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import torch
from jax.experimental import pallas as pl

from torch_pjrt import kernels

EPS = 1e-6


def _row_block(rows: int) -> int:
    """Rows per kernel instance: a divisor of the row count, at most 256."""
    return math.gcd(rows, 256)


def _forward_kernel(x_ref, w_ref, y_ref, *, eps: float):  # noqa: ANN001, ANN202 (Pallas refs)
    x = x_ref[...].astype(jnp.float32)
    inverse_rms = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    y_ref[...] = (x * inverse_rms * w_ref[...].astype(jnp.float32)).astype(y_ref.dtype)


def _backward_kernel(x_ref, w_ref, g_ref, dx_ref, dw_rows_ref, *, eps: float):  # noqa: ANN001, ANN202
    x = x_ref[...].astype(jnp.float32)
    g = g_ref[...].astype(jnp.float32)
    inverse_rms = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    weighted = g * w_ref[...].astype(jnp.float32)
    # d/dx of x * r * w with r = rsqrt(mean(x^2) + eps): r * (u - x * r^2 * mean(u * x)), u = g * w
    dx = inverse_rms * (weighted - x * inverse_rms**2 * jnp.mean(weighted * x, axis=-1, keepdims=True))
    dx_ref[...] = dx.astype(dx_ref.dtype)
    dw_rows_ref[...] = g * x * inverse_rms


def _rows(shape: tuple[int, ...]) -> tuple[int, int]:
    return math.prod(shape[:-1]), shape[-1]


@kernels.jax_op("example::rms_norm")
def rms_norm(x: jax.Array, weight: jax.Array, eps: float = EPS) -> jax.Array:
    """x * rsqrt(mean(x^2, -1) + eps) * weight, one Pallas kernel per block of rows."""
    rows, width = _rows(x.shape)
    block = _row_block(rows)
    y = pl.pallas_call(
        functools.partial(_forward_kernel, eps=eps),
        grid=(rows // block,),
        in_specs=[pl.BlockSpec((block, width), lambda i: (i, 0)), pl.BlockSpec((width,), lambda i: (0,))],
        out_specs=pl.BlockSpec((block, width), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((rows, width), x.dtype),
        interpret=kernels.interpret_mode(),
    )(x.reshape(rows, width), weight)
    return y.reshape(x.shape)


@kernels.jax_op("example::rms_norm_backward")
def rms_norm_backward(x: jax.Array, weight: jax.Array, grad: jax.Array,
                      eps: float = EPS) -> tuple[jax.Array, jax.Array]:
    """The input and weight gradients of rms_norm, one Pallas kernel per block of rows."""
    rows, width = _rows(x.shape)
    block = _row_block(rows)
    row_spec = pl.BlockSpec((block, width), lambda i: (i, 0))
    dx, dw_rows = pl.pallas_call(
        functools.partial(_backward_kernel, eps=eps),
        grid=(rows // block,),
        in_specs=[row_spec, pl.BlockSpec((width,), lambda i: (0,)), row_spec],
        out_specs=[row_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct((rows, width), x.dtype), jax.ShapeDtypeStruct((rows, width), jnp.float32)],
        interpret=kernels.interpret_mode(),
    )(x.reshape(rows, width), weight, grad.reshape(rows, width))
    return dx.reshape(x.shape), dw_rows.sum(axis=0).astype(weight.dtype)


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _backward(ctx, grad: torch.Tensor) -> tuple:  # noqa: ANN001
    x, weight = ctx.saved_tensors
    dx, dw = rms_norm_backward(x, weight, grad, ctx.eps)
    return dx, dw, None


rms_norm.register_autograd(_backward, setup_context=_setup_context)


class PallasRMSNorm(torch.nn.Module):
    """torch.nn.RMSNorm's interface, computed by the Pallas kernels above."""

    def __init__(self, width: int, eps: float = EPS) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def make_model(norm: Callable[[int], torch.nn.Module], vocab: int = 64, width: int = 32) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, width), norm(width), torch.nn.Linear(width, 4 * width),
                                torch.nn.GELU(), torch.nn.Linear(4 * width, width), norm(width),
                                torch.nn.Linear(width, vocab))
    with torch.no_grad():  # a non-trivial norm weight, the same in both models
        for module in model:
            if isinstance(module, (PallasRMSNorm, torch.nn.RMSNorm)):
                module.weight.uniform_(0.5, 1.5)
    return model


def train(model: torch.nn.Module, device: str, steps: int, batch: int = 8, length: int = 16) -> list[float]:
    """Next-token training on a fixed random sequence batch; the losses of every step."""
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model[0].num_embeddings, (batch, length + 1), generator=generator)
    inputs, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    losses = []
    for _ in range(steps):
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    steps = parser.parse_args().steps
    on_pjrt = train(make_model(PallasRMSNorm), "pjrt", steps)
    on_cpu = train(make_model(lambda width: torch.nn.RMSNorm(width, eps=EPS)), "cpu", steps)
    for step, (a, b) in enumerate(zip(on_pjrt, on_cpu)):
        print(f"step {step:3d}  pjrt (Pallas RMSNorm) {a:.6f}  cpu (torch.nn.RMSNorm) {b:.6f}")
    print(f"largest difference {max(abs(a - b) for a, b in zip(on_pjrt, on_cpu)):.2e}")


if __name__ == "__main__":
    main()

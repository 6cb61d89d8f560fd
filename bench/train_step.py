"""The GPT training step (2 layers, width 128, sequence 64, batch 8, AdamW) in every mode, side by side.

Rows: torch CPU eager, torch CPU torch.compile (inductor), pjrt strict eager, pjrt DEFER_AND_FUSE,
pjrt torch.compile(backend="pjrt") of the whole step, and the same model and step written directly
in JAX (jax.jit, hand-written AdamW). Every row starts from the same weights and sees the same batches.
Run: .venv/bin/python bench/train_step.py [--steps N] [--skip-inductor]
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

import torch_pjrt

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from gpt import GPT, batches, corpus_bytes, train_step  # noqa: E402

LR, WEIGHT_DECAY, BETAS, EPS, CLIP = 3e-3, 0.01, (0.9, 0.999), 1e-8, 1.0


def run_torch(model: torch.nn.Module, device: str, data: list, mode: str,
              before_last: Callable[[], None] | None = None) -> dict:
    """Train a copy of the model on the batches; `before_last` runs just before the last step."""
    model = copy.deepcopy(model).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return train_step(model, optimizer, tokens, targets)

    if mode == "compile":
        step = torch.compile(step, backend="pjrt" if device == "pjrt" else "inductor")
    if device == "pjrt":
        torch.pjrt.reset_peak_memory_stats()
        context = torch.pjrt.set_eager_mode("defer_and_fuse" if mode == "fuse" else "defer_never")
    else:
        context = torch.pjrt.set_eager_mode(torch.pjrt.eager_mode)
    times, losses, compiles = [], [], []
    with context:
        for index, (tokens, targets) in enumerate(data):
            if before_last is not None and index == len(data) - 1:
                before_last()
            start = time.perf_counter()
            loss = step(tokens.to(device), targets.to(device)).item()
            times.append(time.perf_counter() - start)
            losses.append(loss)
            compiles.append(torch_pjrt.metrics.counters()["compiles"])
    peak = torch.pjrt.max_memory_allocated() if device == "pjrt" else None
    return {"times": times, "losses": losses, "compiles": compiles, "peak": peak}


# --- the same model and step in JAX ------------------------------------------------------------


def jax_params(model: torch.nn.Module) -> dict:
    return {name: jnp.asarray(value.detach().numpy()) for name, value in model.state_dict().items()}


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * weight + bias


def linear(p: dict, name: str, x: jax.Array) -> jax.Array:
    y = x @ p[f"{name}.weight"].T
    return y + p[f"{name}.bias"] if f"{name}.bias" in p else y


def jax_loss(p: dict, tokens: jax.Array, targets: jax.Array, layers: int, heads: int) -> jax.Array:
    batch, sequence = tokens.shape
    x = p["token.weight"][tokens] + p["position.weight"][:sequence]
    width = x.shape[-1]
    causal = jnp.tril(jnp.ones((sequence, sequence), bool))
    for i in range(layers):
        b = f"blocks.{i}"
        h = layer_norm(x, p[f"{b}.norm1.weight"], p[f"{b}.norm1.bias"])
        q, k, v = jnp.split(linear(p, f"{b}.qkv", h), 3, axis=-1)
        q, k, v = (t.reshape(batch, sequence, heads, width // heads).transpose(0, 2, 1, 3) for t in (q, k, v))
        scores = jnp.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(width // heads), -jnp.inf)
        attention = (jax.nn.softmax(scores, -1) @ v).transpose(0, 2, 1, 3).reshape(batch, sequence, width)
        x = x + linear(p, f"{b}.proj", attention)
        h = layer_norm(x, p[f"{b}.norm2.weight"], p[f"{b}.norm2.bias"])
        x = x + linear(p, f"{b}.mlp.2", jax.nn.gelu(linear(p, f"{b}.mlp.0", h), approximate=False))
    logits = linear(p, "head", layer_norm(x, p["norm.weight"], p["norm.bias"]))
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.take_along_axis(logp, targets[..., None], -1).mean()


def run_jax(model: torch.nn.Module, data: list, layers: int, heads: int) -> dict:
    params = jax_params(model)
    state = {"m": jax.tree.map(jnp.zeros_like, params), "v": jax.tree.map(jnp.zeros_like, params)}

    @jax.jit
    def step(params: dict, state: dict, count: jax.Array, tokens: jax.Array, targets: jax.Array) -> tuple:
        loss, grads = jax.value_and_grad(jax_loss)(params, tokens, targets, layers, heads)
        total = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
        grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, CLIP / (total + 1e-6)), grads)
        m = jax.tree.map(lambda m, g: BETAS[0] * m + (1 - BETAS[0]) * g, state["m"], grads)
        v = jax.tree.map(lambda v, g: BETAS[1] * v + (1 - BETAS[1]) * g * g, state["v"], grads)
        c1, c2 = 1 - BETAS[0] ** count, 1 - BETAS[1] ** count

        def update(p: jax.Array, m: jax.Array, v: jax.Array) -> jax.Array:
            p = p * (1 - LR * WEIGHT_DECAY)
            return p - LR * (m / c1) / (jnp.sqrt(v / c2) + EPS)

        return jax.tree.map(update, params, m, v), {"m": m, "v": v}, loss

    times, losses = [], []
    for count, (tokens, targets) in enumerate(data, start=1):
        start = time.perf_counter()
        params, state, loss = step(params, state, jnp.float32(count), jnp.asarray(tokens.numpy()),
                                   jnp.asarray(targets.numpy()))
        losses.append(float(loss))
        times.append(time.perf_counter() - start)
    return {"times": times, "losses": losses, "compiles": None, "peak": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip-inductor", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    layers, heads = 2, 4
    model = GPT(width=128, layers=layers, heads=heads, context=64)
    data = batches(corpus_bytes(), 8, 64, args.steps)

    rows: dict[str, Callable[[], dict]] = {
        "torch CPU eager": lambda: run_torch(model, "cpu", data, "eager"),
        "torch CPU inductor": lambda: run_torch(model, "cpu", data, "compile"),
        "pjrt strict eager": lambda: run_torch(model, "pjrt", data, "eager"),
        "pjrt DEFER_AND_FUSE": lambda: run_torch(model, "pjrt", data, "fuse"),
        "pjrt torch.compile": lambda: run_torch(model, "pjrt", data, "compile"),
        "JAX jit (hand-written)": lambda: run_jax(model, data, layers, heads),
    }
    if args.skip_inductor:
        del rows["torch CPU inductor"]
    results = {name: run() for name, run in rows.items()}

    warm = slice(3, None)
    medians = {name: statistics.median(r["times"][warm]) for name, r in results.items()}
    print(f"GPT step (2 layers, width 128, seq 64, batch 8, AdamW), {args.steps} steps, median of steps 4+")
    print(f"{'':<26}{'first step s':>13}{'step ms':>10}{'p10-p90 ms':>16}{'compiles 4+':>13}{'peak MiB':>10}"
          f"{'loss diff':>11}")
    reference = results["torch CPU eager"]["losses"]
    for name, r in results.items():
        spread = np.percentile(np.array(r["times"][warm]) * 1e3, [10, 90])
        new_compiles = "-" if r["compiles"] is None else str(r["compiles"][-1] - r["compiles"][2])
        peak = "-" if r["peak"] is None else f"{r['peak'] / 2**20:.1f}"
        diff = max(abs(a - b) for a, b in zip(r["losses"], reference))
        print(f"{name:<26}{r['times'][0]:>13.2f}{medians[name] * 1e3:>10.1f}"
              f"{f'{spread[0]:.1f}-{spread[1]:.1f}':>16}{new_compiles:>13}{peak:>10}{diff:>11.1e}")
    print("\nratios (median step time)")
    for a, b, goal in (
        ("pjrt strict eager", "pjrt DEFER_AND_FUSE", "fused at least 2x faster than strict"),
        ("pjrt DEFER_AND_FUSE", "pjrt torch.compile", "fused within 1.5x of compiled"),
        ("pjrt torch.compile", "JAX jit (hand-written)", "compiled at most 1.10x JAX"),
        ("torch CPU eager", "pjrt torch.compile", "torch CPU eager vs pjrt compiled"),
    ):
        print(f"  {a} / {b}: {medians[a] / medians[b]:.2f}   ({goal})")


if __name__ == "__main__":
    main()

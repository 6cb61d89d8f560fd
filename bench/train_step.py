"""The GPT training step (2 layers, width 128, sequence 64, batch 8, AdamW) in every mode, side by side.

Rows: torch CPU eager, torch CPU torch.compile (inductor), pjrt strict eager, pjrt DEFER_AND_FUSE,
pjrt torch.compile(backend="pjrt") of the whole step, and the same model and step written directly
in JAX (jax.jit, hand-written AdamW, donated state). Every row starts from the same weights and sees the
same batches; after a warm-up the rows take turns, a round of steps each, and the best round counts.
`--adamw fused` builds the torch rows' AdamW with fused=True (one aten::_fused_adamw_ per step instead of
PyTorch's default: the multi-tensor _foreach_* ops on pjrt, the per-parameter loop on CPU); `--adamw both` keeps
the default and adds a DEFER_AND_FUSE row with fused=True, so the two optimizers' fused steps take turns in the
same rounds (on this shared machine, two runs meet different loads).
The compiled step is four programs (forward, backward, clip, AdamW: backward and the optimizer's step break
Dynamo's graph). `--compiled-autograd` adds a row compiled with torch._dynamo.config.compiled_autograd on (Dynamo
traces the backward into a graph of its own: still four programs). `--traced-backward` adds a row whose step
detaches its loss before the optimizer's step, compiled with torch._dynamo.config.trace_autograd_ops on: Dynamo
traces loss.backward() into the forward's graph, so the step is two programs (forward, backward and clip; AdamW).
Run: .venv/bin/python bench/train_step.py [--rounds 5] [--steps 8] [--skip-inductor] [--skip-fused] [--cpu-threads 1]
     [--adamw default|fused|both] [--compiled-autograd] [--traced-backward]
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
import os
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import torch

import torch_pjrt

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from gpt import GPT, batches, corpus_bytes, loss_fn, train_step  # noqa: E402

LR, WEIGHT_DECAY, BETAS, EPS, CLIP = 3e-3, 0.01, (0.9, 0.999), 1e-8, 1.0
# Largest |loss difference| from torch CPU eager for the JAX step to count as the same step (float32 drift).
LOSS_TOLERANCE = 1e-3


def train_step_detached_first(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """gpt.train_step with its loss detached before the optimizer's step: no tensor holding the backward's graph
    lives across the step's graph break, which Dynamo needs to trace loss.backward() (trace_autograd_ops)."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model, tokens, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    detached = loss.detach()
    del loss
    optimizer.step()
    return detached


class TorchRow:
    """The step run by PyTorch on one device and in one mode, on its own copy of the model and optimizer.
    `backward`: how a compiled step's backward runs: "autograd" (AOTAutograd's backward, called by autograd),
    "compiled autograd" or "traced" (train_step_detached_first with Dynamo's trace_autograd_ops)."""

    def __init__(self, model: torch.nn.Module, device: str, mode: str, cpu_threads: int, fused_adamw: bool,
                 backward: str = "autograd") -> None:
        self.device = device
        self.trace_autograd_ops = backward == "traced"
        self.cpu_threads = cpu_threads
        self.eager_mode = "defer_and_fuse" if mode == "fuse" else "defer_never"
        self.model = copy.deepcopy(model).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                           fused=fused_adamw or None)
        step = train_step_detached_first if self.trace_autograd_ops else train_step
        self.step = functools.partial(step, self.model, self.optimizer)
        if mode == "compile":
            # torch.compile reads the compiled autograd setting when it wraps the step.
            with torch._dynamo.config.patch(compiled_autograd=backward == "compiled autograd"):
                self.step = torch.compile(self.step, backend="pjrt" if device == "pjrt" else "inductor")

    def run(self, data: list) -> tuple[float, list[float]]:
        """Seconds for the steps on the batches (until every update is done) and each step's loss, read back."""
        losses = []
        mode = self.eager_mode if self.device == "pjrt" else torch.pjrt.eager_mode
        threads = torch.get_num_threads()
        torch.set_num_threads(self.cpu_threads)
        try:
            # Dynamo reads trace_autograd_ops when it traces a frame (the first steps, a recompile).
            tracing = torch._dynamo.config.patch(trace_autograd_ops=self.trace_autograd_ops)
            with torch.pjrt.set_eager_mode(mode), tracing:
                start = time.perf_counter()
                for tokens, targets in data:
                    losses.append(self.step(tokens.to(self.device), targets.to(self.device)).item())
                if self.device == "pjrt":
                    torch.pjrt.synchronize()
                return time.perf_counter() - start, losses
        finally:
            torch.set_num_threads(threads)


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


class JaxRow:
    """The same model and AdamW step written directly in JAX: one jax.jit of loss, gradients, clipping and update."""

    def __init__(self, model: torch.nn.Module, layers: int, heads: int) -> None:
        self.params = jax_params(model)
        self.state = {"m": jax.tree.map(jnp.zeros_like, self.params), "v": jax.tree.map(jnp.zeros_like, self.params)}
        self.count = 0

        @functools.partial(jax.jit, donate_argnums=(0, 1))
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

        self.step = step

    def run(self, data: list) -> tuple[float, list[float]]:
        losses = []
        start = time.perf_counter()
        for tokens, targets in data:
            self.count += 1
            self.params, self.state, loss = self.step(self.params, self.state, jnp.float32(self.count),
                                                      jnp.asarray(tokens.numpy()), jnp.asarray(targets.numpy()))
            losses.append(float(loss))
        # The loss can be read before the rest of the program has run: a step ends with its updates.
        jax.block_until_ready((self.params, self.state))
        return time.perf_counter() - start, losses


def compiles() -> int:
    return torch_pjrt.metrics.counters()["compiles"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--warmup", type=int, default=3, help="steps each row runs alone first (compiles)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; each row's best round is kept")
    parser.add_argument("--steps", type=int, default=8, help="steps per row in each round")
    parser.add_argument("--skip-inductor", action="store_true")
    parser.add_argument("--skip-fused", action="store_true")
    parser.add_argument("--cpu-threads", type=int, default=1,
                        help="torch's CPU threads while a row runs (on a shared 2-core machine, two threads spin "
                             "against every other process: torch CPU eager's step read 10-20x slower)")
    parser.add_argument("--adamw", choices=["default", "fused", "both"], default="default",
                        help="the torch rows' AdamW: PyTorch's default implementation, or fused=True; both: the "
                             "default, and a DEFER_AND_FUSE row with fused=True besides")
    parser.add_argument("--compiled-autograd", action="store_true",
                        help="add the pjrt torch.compile row with compiled autograd on")
    parser.add_argument("--traced-backward", action="store_true",
                        help="add the pjrt torch.compile row whose backward Dynamo traces (two programs a step)")
    args = parser.parse_args()
    fused = args.adamw == "fused"
    torch.manual_seed(0)
    layers, heads = 2, 4
    model = GPT(width=128, layers=layers, heads=heads, context=64)
    data = batches(corpus_bytes(), 8, 64, args.warmup + args.rounds * args.steps)

    makers: dict[str, Callable[[], TorchRow | JaxRow]] = {
        "torch CPU eager": lambda: TorchRow(model, "cpu", "eager", args.cpu_threads, fused),
        "torch CPU inductor": lambda: TorchRow(model, "cpu", "compile", args.cpu_threads, fused),
        "pjrt strict eager": lambda: TorchRow(model, "pjrt", "eager", args.cpu_threads, fused),
        "pjrt DEFER_AND_FUSE": lambda: TorchRow(model, "pjrt", "fuse", args.cpu_threads, fused),
        "pjrt torch.compile": lambda: TorchRow(model, "pjrt", "compile", args.cpu_threads, fused),
        "JAX jit (hand-written)": lambda: JaxRow(model, layers, heads),
    }
    if args.adamw == "both":
        makers["pjrt DEFER_AND_FUSE, fused AdamW"] = lambda: TorchRow(model, "pjrt", "fuse", args.cpu_threads, True)
    if args.compiled_autograd:
        makers["pjrt compile, compiled AG"] = lambda: TorchRow(model, "pjrt", "compile", args.cpu_threads, fused,
                                                               backward="compiled autograd")
    if args.traced_backward:
        makers["pjrt compile, traced bwd"] = lambda: TorchRow(model, "pjrt", "compile", args.cpu_threads, fused,
                                                              backward="traced")
    if args.skip_inductor:
        del makers["torch CPU inductor"]
    if args.skip_fused:
        del makers["pjrt DEFER_AND_FUSE"]
    rows, first, peak, losses = {}, {}, {}, {name: [] for name in makers}
    for name, make in makers.items():  # each row alone: its model made, its programs compiled
        base = torch.pjrt.memory_allocated()
        torch.pjrt.reset_peak_memory_stats()
        rows[name] = make()
        first[name], found = rows[name].run(data[:1])
        losses[name] += found + rows[name].run(data[1:args.warmup])[1]
        peak[name] = (torch.pjrt.max_memory_allocated() - base) if "pjrt" in name else None
    round_means: dict[str, list[float]] = {name: [] for name in rows}
    # CPU seconds per step (the main thread's, and the whole process's): on this shared machine a figure the
    # load barely moves, and on a CPU backend the host's share of the cores the programs also run on.
    round_cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in rows}
    new_compiles = dict.fromkeys(rows, 0)
    for index in range(args.rounds):
        chunk = data[args.warmup + index * args.steps:args.warmup + (index + 1) * args.steps]
        for name, row in rows.items():
            before = compiles()
            thread_cpu, process_cpu = time.thread_time(), time.process_time()
            seconds, found = row.run(chunk)
            round_cpu[name].append(((time.thread_time() - thread_cpu) / len(chunk),
                                    (time.process_time() - process_cpu) / len(chunk)))
            new_compiles[name] += compiles() - before
            losses[name] += found
            round_means[name].append(seconds / len(chunk))

    best = {name: min(means) for name, means in round_means.items()}
    adamw = {"default": "AdamW", "fused": "fused AdamW", "both": "AdamW (and fused AdamW where named)"}[args.adamw]
    print(f"GPT step (2 layers, width 128, seq 64, batch 8, {adamw}), {args.warmup} warm-up steps, then {args.rounds} "
          f"interleaved rounds of {args.steps} steps per row; step ms: the best round's wall time per step, "
          f"its last update done; torch CPU threads: {args.cpu_threads}")
    print(f"{'':<33}{'first step s':>13}{'step ms':>10}{'rounds ms':>16}{'compiles':>10}{'peak MiB':>10}"
          f"{'loss diff':>11}{'host cpu ms':>13}{'all cpu ms':>12}")
    reference = losses["torch CPU eager"]
    differences = {}
    for name in rows:
        differences[name] = max(abs(loss - ref) for loss, ref in zip(losses[name], reference))
        spread = f"{min(round_means[name]) * 1e3:.1f}-{max(round_means[name]) * 1e3:.1f}"
        grown = "-" if name.startswith("JAX") else str(new_compiles[name])
        memory = "-" if peak[name] is None else f"{peak[name] / 2**20:.1f}"
        host_cpu = min(cpu[0] for cpu in round_cpu[name]) * 1e3
        all_cpu = min(cpu[1] for cpu in round_cpu[name]) * 1e3
        print(f"{name:<33}{first[name]:>13.2f}{best[name] * 1e3:>10.1f}{spread:>16}{grown:>10}{memory:>10}"
              f"{differences[name]:>11.1e}{host_cpu:>13.1f}{all_cpu:>12.1f}")
    print("(compiles: new programs during the timed rounds; peak MiB: pjrt memory the row added while warming up; "
          "loss diff: largest |loss - torch CPU eager's loss| over all steps; host / all cpu ms: the least CPU time "
          "per step of any round, the main thread's / every thread's)")
    jax_difference = differences["JAX jit (hand-written)"]
    if jax_difference > LOSS_TOLERANCE:
        raise SystemExit(f"the JAX step's losses differ from torch CPU eager's by {jax_difference:.1e} (more than "
                         f"{LOSS_TOLERANCE}): it is not the same step, so its ratios mean nothing.")
    print("\nratios (best rounds)")
    for a, b, goal in (
        ("pjrt strict eager", "pjrt DEFER_AND_FUSE", "fused at least 2x faster than strict"),
        ("pjrt DEFER_AND_FUSE", "pjrt torch.compile", "fused within 1.5x of compiled"),
        ("torch CPU eager", "pjrt torch.compile", "torch CPU eager vs pjrt compiled"),
    ):
        if a in best and b in best:
            print(f"  {a} / {b}: {best[a] / best[b]:.2f}   ({goal})")
    print("goals against the hand-written JAX step")
    goals = (("pjrt torch.compile", 1.10), ("pjrt compile, compiled AG", 1.10), ("pjrt compile, traced bwd", 1.10),
             ("pjrt DEFER_AND_FUSE", 1.15), ("pjrt DEFER_AND_FUSE, fused AdamW", 1.15))
    for name, goal in goals:
        if name not in best:
            continue
        ratio = best[name] / best["JAX jit (hand-written)"]
        print(f"  {name} / JAX: {ratio:.2f}   (goal <= {goal:.2f}: {'met' if ratio <= goal else 'not met'})")


if __name__ == "__main__":
    main()

"""Flash attention (torch_pjrt.kernels, jax's Pallas kernel) against the SDPA lowering, side by side.

For each (batch, heads, seq, head_dim) shape, causal, float32: the forward alone and forward plus
backward of `kernels.flash_attention` and of `scaled_dot_product_attention` without the switch
(PyTorch's math decomposition, lowered op by op). Both run in one process, in interleaved rounds
(flash, sdpa, sdpa, flash, ...) so drift hits both alike; shown are each one's best round (the
fastest of --repeats calls) and the ratio flash / sdpa of those (below 1: the kernel is faster).
On CPU the kernel runs in Pallas's interpret mode (a loop over blocks in plain XLA), so it is
expected to be slower there; on GPU and TPU it compiles for real, and that ratio is the one that counts.
Run: .venv/bin/python bench/flash_attention.py [--rounds N] [--repeats K] [--shapes 2,8,512,64 ...]
     [--mode strict|compile]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import torch_pjrt
from torch_pjrt import kernels
from torch_pjrt.runtime import client

SHAPES = ("2,8,512,64", "1,8,2048,64")


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return kernels.flash_attention(q, k, v, causal=True)


def timed(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    """The fastest of `repeats` calls, in seconds, each until one element of its result is on the
    host (so the work is done, in every mode)."""
    best = float("inf")
    for _ in range(repeats):
        begin = time.perf_counter()
        fn().view(-1)[0].item()
        best = min(best, time.perf_counter() - begin)
    return best


def passes(attention: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           grad: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """The forward alone (no autograd) and forward plus backward (q's gradient) of one function."""

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return attention(q, k, v)

    def forward_backward() -> torch.Tensor:
        q.grad = k.grad = v.grad = None
        attention(q, k, v).backward(grad)
        return q.grad

    return {"forward": forward, "forward+backward": forward_backward}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="batch,heads,seq,head_dim")
    parser.add_argument("--mode", choices=("strict", "compile"), default="strict",
                        help="strict eager ops, or each function under torch.compile(backend='pjrt')")
    args = parser.parse_args()
    torch.manual_seed(0)
    variants = {"flash": flash, "sdpa": sdpa}
    if args.mode == "compile":
        variants = {name: torch.compile(fn, backend="pjrt", fullgraph=True) for name, fn in variants.items()}
    print(f"platform {client.platform()}, interpret mode {kernels.interpret_mode()}, {args.mode}, causal float32, "
          f"best of {args.rounds} interleaved rounds x {args.repeats} calls")
    print(f"{'shape (b, h, s, d)':<22}{'pass':<18}{'flash ms':>10}{'sdpa ms':>10}{'flash/sdpa':>12}")
    for text in args.shapes:
        shape = tuple(int(n) for n in text.split(","))
        q, k, v = (torch.randn(shape, device="pjrt", requires_grad=True) for _ in range(3))
        grad = torch.randn(shape, device="pjrt")
        runs = {name: passes(fn, q, k, v, grad) for name, fn in variants.items()}
        for name in runs:  # compile everything once, outside the timing
            for run in runs[name].values():
                run()
        best: dict[tuple[str, str], float] = {}
        for round_index in range(args.rounds):
            order = list(runs) if round_index % 2 == 0 else list(reversed(runs))
            for name in order:
                for pass_name, run in runs[name].items():
                    seconds = timed(run, args.repeats)
                    best[name, pass_name] = min(best.get((name, pass_name), float("inf")), seconds)
        for pass_name in ("forward", "forward+backward"):
            ours, theirs = best["flash", pass_name], best["sdpa", pass_name]
            print(f"{str(shape):<22}{pass_name:<18}{ours * 1e3:>10.1f}{theirs * 1e3:>10.1f}{ours / theirs:>12.2f}")
    counts = torch_pjrt.metrics.counters()
    print(f"programs compiled: {counts['compiles']}")


if __name__ == "__main__":
    main()

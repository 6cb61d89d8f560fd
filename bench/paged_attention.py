"""The paged-attention kernel (torch_pjrt.kernels.paged_attention) against its torch-op path, side by side.

Attention of query tokens over a 2-layer paged KV cache (float32, 8 query heads over 2 kv heads, head size
64, blocks of 16 positions), each token's context in random blocks: `kernels.paged_attention` (a Pallas
kernel reading the pages through the block tables) and `paged.gathered_attention` (what the vLLM plugin
runs without TORCH_PJRT_PAGED_ATTENTION: each token's context gathered with torch ops). Cases: decode
batches (one query token per request, short and long contexts) and a prefill chunk (many tokens of one
request); the cache holds exactly the requests' blocks. Both run
in one process in interleaved rounds; shown are each one's best round (the fastest of --repeats calls) and
the ratio kernel / torch ops (below 1: the kernel is faster). On CPU the kernel runs in Pallas's interpret
mode, so it is expected to be slower there; the GPU ratio (`bash bench/accelerator.sh`) is the one that counts.
A second table times the torch-op path's page gathers alone (`page_gather.gather_pages`'s lowering, one
layer's keys and values, jitted): the CPU custom call (torch_pjrt._xla_cpu_kernels) against XLA's gathers (its
fallback on other platforms), at these cases' shapes and at the vLLM serving bench's decode step (32 requests,
2 kv heads, head size 32, 8 pages of 16: bench/serving.py's tiny Llama); below 1: the custom call is faster.
Run: .venv/bin/python bench/paged_attention.py [--rounds N] [--repeats K] [--mode strict|fused]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

import torch_pjrt
from torch_pjrt import kernels
from torch_pjrt.kernels import page_gather, paged
from torch_pjrt.runtime import client

HEADS, KV_HEADS, SIZE, BLOCK, LAYERS = 8, 2, 64, 16, 2
# (name, query tokens, requests, context positions per request)
# (the cache holds every request's context: requests x context / 16 blocks, plus vLLM's null block)
CASES = (("decode", 16, 16, 64), ("decode", 16, 16, 1024), ("prefill chunk", 128, 1, 256))
# (name, query tokens, kv heads, head size, pages of BLOCK per token) of the gathers' table, besides CASES
SERVING_STEP = ("serving decode", 32, 2, 32, 8)


def inputs(tokens: int, requests: int, context: int) -> dict[str, torch.Tensor]:
    """Both paths' arguments on pjrt: a cache of random rows, each request's blocks a random set of them."""
    pages = context // BLOCK
    blocks = requests * pages + 1
    cache = torch.randn(LAYERS, blocks, KV_HEADS, BLOCK, 2 * SIZE)
    tables = torch.randperm(blocks - 1)[: requests * pages].view(requests, pages) + 1
    request = torch.arange(tokens) * requests // tokens
    # each request's tokens are its last positions: a decode token sees its whole context
    per_request = tokens // requests
    positions = context - per_request + torch.arange(tokens) % per_request
    span = torch.arange(context)
    found = dict(query=torch.randn(tokens, HEADS, SIZE), cache=cache, tables=tables[request],
                 lengths=(positions + 1).int(), visible=span[None, :] <= positions[:, None])
    return {name: t.to("pjrt") for name, t in found.items()}


def kernel(a: dict[str, torch.Tensor]) -> torch.Tensor:
    return kernels.paged_attention(a["query"], a["cache"], a["tables"].int(), a["lengths"], layer=1, scale=0.125)


def torch_ops(a: dict[str, torch.Tensor]) -> torch.Tensor:
    return paged.gathered_attention(a["query"], a["cache"][1], a["tables"], a["visible"], scale=0.125)


def timed(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    """The fastest of `repeats` calls, in seconds, each until one element of its result is on the host."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn().view(-1)[0].item()
        best = min(best, time.perf_counter() - start)
    return best


def gather_shapes() -> list[tuple[str, int, int, int, int]]:
    """The gathers' cases: CASES's shapes (each token its own pages) and the serving bench's decode step."""
    return [(name, tokens, KV_HEADS, SIZE, context // BLOCK) for name, tokens, _, context in CASES] + [SERVING_STEP]


def time_gathers(rounds: int, repeats: int) -> None:
    """One layer's keys and values by the custom call and by XLA's gathers, alternated; equal results first."""
    jax = client.jax_module()
    if page_gather.native_target() is None:
        print("page gathers: torch_pjrt._xla_cpu_kernels is not built; nothing to compare")
        return
    print(f"page gathers, one layer of {LAYERS}, float32, blocks of {BLOCK}, jitted")
    print(f"{'case':<16}{'tokens':>8}{'kv heads':>10}{'head size':>11}{'context':>9}{'custom call us':>16}"
          f"{'XLA gathers us':>16}{'custom/XLA':>12}")
    for name, tokens, kv_heads, size, pages in gather_shapes():
        blocks = tokens * pages + 1
        cache = jax.numpy.asarray(torch.randn(LAYERS, blocks, kv_heads, BLOCK, 2 * size).numpy())
        tables = jax.numpy.asarray((torch.randperm(blocks - 1)[: tokens * pages].view(tokens, pages) + 1).numpy())
        arguments = (cache, tables, jax.numpy.asarray([1]))
        runs = {flag: jax.jit(functools.partial(page_gather._gather_pages, native=flag)) for flag in (True, False)}
        if not all(bool((mine == xla).all()) for mine, xla in zip(*(runs[f](*arguments) for f in (True, False)))):
            raise RuntimeError(f"{name}: the custom call's pages differ from XLA's gathers")
        best = {True: float("inf"), False: float("inf")}
        for round_index in range(rounds):
            for flag in (True, False) if round_index % 2 == 0 else (False, True):
                for _ in range(repeats):
                    start = time.perf_counter()
                    jax.block_until_ready(runs[flag](*arguments))
                    best[flag] = min(best[flag], time.perf_counter() - start)
        print(f"{name:<16}{tokens:>8}{kv_heads:>10}{size:>11}{pages * BLOCK:>9}{best[True] * 1e6:>16.1f}"
              f"{best[False] * 1e6:>16.1f}{best[True] / best[False]:>12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", choices=("strict", "fused"), default="strict")
    args = parser.parse_args()
    mode = torch_pjrt.EagerMode.DEFER_AND_FUSE if args.mode == "fused" else torch_pjrt.EagerMode.DEFER_NEVER
    print(f"platform {client.platform()}, {args.mode} eager, float32, {HEADS} heads over {KV_HEADS} kv heads, "
          f"head size {SIZE}, blocks of {BLOCK}; best of {args.rounds} interleaved rounds x {args.repeats} calls")
    print(f"{'case':<16}{'tokens':>8}{'context':>9}{'blocks':>8}{'kernel ms':>11}{'torch ops ms':>14}"
          f"{'kernel/torch':>14}")
    with torch.pjrt.set_eager_mode(mode):
        for name, tokens, requests, context in CASES:
            a = inputs(tokens, requests, context)
            difference = (kernel(a) - torch_ops(a)).abs().max().item()  # also the compiles, outside the timing
            if difference > 1e-4:
                raise RuntimeError(f"{name}: the kernel and the torch ops differ by {difference}")
            best = {"kernel": float("inf"), "torch": float("inf")}
            for round_index in range(args.rounds):
                order = (("kernel", kernel), ("torch", torch_ops))
                for label, fn in order if round_index % 2 == 0 else order[::-1]:
                    best[label] = min(best[label], timed(lambda fn=fn, a=a: fn(a), args.repeats))
            blocks = a["cache"].shape[1]
            print(f"{name:<16}{tokens:>8}{context:>9}{blocks:>8}{best['kernel'] * 1e3:>11.2f}"
                  f"{best['torch'] * 1e3:>14.2f}{best['kernel'] / best['torch']:>14.2f}")

    time_gathers(args.rounds, 20 * args.repeats)


if __name__ == "__main__":
    main()

"""all_reduce on pjrt tensors through each engine against gloo on CPU tensors, and DDP against one process.

Run: TORCH_PJRT_CPU_DEVICES=2 torchrun --nproc-per-node 2 bench/allreduce.py
Prints, from rank 0, float32 all_reduce from 1 KiB to 64 MiB: milliseconds per call and bus bandwidth
(2(n-1)/n x bytes / time, NCCL's convention) on pjrt tensors through the XLA engine (jax's
multi-process runtime: one XLA program per call, no host copies) and the host engine (host
copies + gloo), and on CPU tensors in a plain gloo group (the transport's own cost); the host
transfers each pjrt call made; the ratio XLA / gloo. Each cell is the best median of interleaved
rounds (this machine is shared). Then the small GPT's training step: one process on the full batch,
and DDP with every rank on its slice, on each engine, with the largest loss difference from the
single process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import torch_pjrt.distributed
from torch_pjrt import metrics

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from gpt import GPT, batches, corpus_bytes, train_step  # noqa: E402

SIZES = [1 << shift for shift in range(10, 27, 2)]  # 1 KiB .. 64 MiB


def seconds_per_call(fn: Callable[[], object], repeats: int) -> float:
    fn()
    torch.pjrt.synchronize()
    dist.barrier()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def transfers_per_call(fn: Callable[[], object]) -> int:
    torch.pjrt.synchronize()
    metrics.reset()
    fn()
    torch.pjrt.synchronize()
    counts = metrics.counters()
    return int(counts["transfers_to_host"] + counts["transfers_to_device"])


def human(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def bandwidth_table(device: torch.device, rounds: int) -> list[str]:
    world = dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    host = dist.new_group(backend="pjrt")
    host.use_host_engine()
    engine = torch_pjrt.distributed.engine()["engine"]
    rows = [
        "| size | XLA engine ms | GB/s | transfers | host engine ms | GB/s | transfers | CPU gloo ms | GB/s "
        "| XLA / gloo |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for nbytes in SIZES:
        repeats = max(3, min(30, (8 << 20) // nbytes))
        cpu = torch.randn(nbytes // 4)
        on_device = cpu.to(device)
        calls = [
            lambda t=on_device: dist.all_reduce(t),
            lambda t=on_device: dist.all_reduce(t, group=host),
            lambda t=cpu: dist.all_reduce(t, group=gloo),
        ]
        best = [float("inf")] * 3
        for _ in range(rounds):
            for index, call in enumerate(calls):
                best[index] = min(best[index], seconds_per_call(call, repeats))
        moves = [transfers_per_call(calls[0]), transfers_per_call(calls[1])]
        bus = [2 * (world - 1) / world * nbytes / t / 1e9 for t in best]
        rows.append(
            f"| {human(nbytes)} | {best[0] * 1e3:.2f} | {bus[0]:.3f} | {moves[0]} | {best[1] * 1e3:.2f} | "
            f"{bus[1]:.3f} | {moves[1]} | {best[2] * 1e3:.2f} | {bus[2]:.3f} | {best[0] / best[2]:.2f} |"
        )
    return [f"default group's engine: {engine}", *rows]


def run_steps(model: torch.nn.Module, data: list, device: torch.device, shard: bool) -> tuple[float, list[float]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    samples, losses = [], []
    for index, (tokens, targets) in enumerate(data):
        if shard:
            tokens, targets = tokens.chunk(world)[rank], targets.chunk(world)[rank]
        start = time.perf_counter()
        loss = train_step(model, optimizer, tokens.to(device), targets.to(device))
        if shard:  # the global batch's loss, to compare with the single process
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
        if index >= 2:  # the first steps compile
            samples.append(time.perf_counter() - start)
    return statistics.median(samples), losses


def ddp_table(device: torch.device, steps: int, batch: int) -> list[str]:
    from torch.nn.parallel import DistributedDataParallel

    data = batches(corpus_bytes(), batch, 64, steps)
    torch.manual_seed(0)
    single, reference = 1.0, [0.0] * steps
    if dist.get_rank() == 0:  # the other ranks wait, so the single process has the machine
        single, reference = run_steps(GPT().to(device), data, device, shard=False)
    world = dist.get_world_size()
    rows = [f"| GPT step, global batch {batch} | ms/step | samples/s | largest loss difference |",
            "|---|---:|---:|---:|", f"| 1 process, full batch | {single * 1e3:.1f} | {batch / single:.1f} | |"]
    host = dist.new_group(backend="pjrt")
    host.use_host_engine()
    for name, group in (("XLA engine", None), ("host engine", host)):
        dist.barrier()
        torch.manual_seed(0)
        model = DistributedDataParallel(GPT().to(device), process_group=group)
        seconds, losses = run_steps(model, data, device, shard=True)
        difference = max(abs(a - b) for a, b in zip(losses, reference))
        rows.append(f"| DDP {name}, {world} ranks x {batch // world} | {seconds * 1e3:.1f} | {batch / seconds:.1f} | "
                    f"{difference:.1e} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch_pjrt.distributed.register()
    dist.init_process_group()
    device = torch_pjrt.distributed.local_device()
    torch.pjrt.set_device(device)
    rows = bandwidth_table(device, args.rounds) + [""] + ddp_table(device, args.steps, args.batch)
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks, rank 0 on {device}, {os.cpu_count()} CPU cores")
        print("\n".join(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

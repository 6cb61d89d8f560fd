"""all_reduce bandwidth on pjrt tensors, and DDP step time against a single process.

Run: TORCH_PJRT_CPU_DEVICES=2 torchrun --nproc-per-node 2 bench/allreduce.py
Prints, from rank 0, the time and bus bandwidth (2(n-1)/n x bytes / time, NCCL's convention) of
float32 all_reduce from 1 KiB to 64 MiB on pjrt tensors (host copies + gloo) and on CPU tensors
in a plain gloo group (the transport's own cost), then the small GPT's training step time: one process on
the full batch, and DDP with every rank on its slice.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import torch_pjrt.distributed

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from gpt import GPT, batches, corpus_bytes, train_step  # noqa: E402

SIZES = [1 << shift for shift in range(10, 27, 2)]  # 1 KiB .. 64 MiB


def seconds_per_call(fn, repeats: int) -> float:  # noqa: ANN001
    fn()
    dist.barrier()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def human(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def bandwidth_table(device: torch.device) -> list[str]:
    world = dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    rows = ["| size | pjrt ms | pjrt GB/s | CPU, gloo ms | CPU, gloo GB/s |", "|---:|---:|---:|---:|---:|"]
    for nbytes in SIZES:
        repeats = max(3, min(30, (8 << 20) // nbytes))
        cpu = torch.randn(nbytes // 4)
        on_device = cpu.to(device)
        times = [
            seconds_per_call(lambda t=on_device: dist.all_reduce(t), repeats),
            seconds_per_call(lambda t=cpu: dist.all_reduce(t, group=gloo), repeats),
        ]
        bus = [2 * (world - 1) / world * nbytes / t / 1e9 for t in times]
        rows.append(f"| {human(nbytes)} | {times[0] * 1e3:.2f} | {bus[0]:.3f} | {times[1] * 1e3:.2f} | {bus[1]:.3f} |")
    return rows


def step_time(model: torch.nn.Module, data: list, device: torch.device, shard: bool) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    samples = []
    for index, (tokens, targets) in enumerate(data):
        if shard:
            tokens, targets = tokens.chunk(world)[rank], targets.chunk(world)[rank]
        start = time.perf_counter()
        train_step(model, optimizer, tokens.to(device), targets.to(device)).item()
        if index >= 2:  # the first steps compile
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def ddp_table(device: torch.device, steps: int, batch: int) -> list[str]:
    from torch.nn.parallel import DistributedDataParallel

    data = batches(corpus_bytes(), batch, 64, steps)
    torch.manual_seed(0)
    single = step_time(GPT().to(device), data, device, shard=False) if dist.get_rank() == 0 else 0.0
    dist.barrier()
    torch.manual_seed(0)
    parallel = step_time(DistributedDataParallel(GPT().to(device)), data, device, shard=True)
    world = dist.get_world_size()
    if dist.get_rank() != 0:
        return []
    return [
        f"| GPT step, global batch {batch} | ms/step | samples/s |", "|---|---:|---:|",
        f"| 1 process, full batch | {single * 1e3:.1f} | {batch / single:.1f} |",
        f"| DDP, {world} ranks x {batch // world} | {parallel * 1e3:.1f} | {batch / parallel:.1f} |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    torch_pjrt.distributed.register()
    dist.init_process_group()
    device = torch_pjrt.distributed.local_device()
    torch.pjrt.set_device(device)
    rows = bandwidth_table(device) + [""] + ddp_table(device, args.steps, args.batch)
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks, rank 0 on {device}, {os.cpu_count()} CPU cores")
        print("\n".join(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

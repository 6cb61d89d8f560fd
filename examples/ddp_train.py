"""Data-parallel training of the small GPT on pjrt devices with DistributedDataParallel.

Run: torchrun --nproc-per-node 2 examples/ddp_train.py
(add TORCH_PJRT_CPU_DEVICES=2 to give each CPU process two devices: rank r then uses pjrt:r).
Every rank trains on its own slice of each batch; DDP averages the gradients in buckets over
the "pjrt" c10d backend, so every rank ends each step with the same weights.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from gpt import GPT, batches, corpus_bytes, train_on_ranks
from torch.nn.parallel import DistributedDataParallel

import torch_pjrt.distributed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="global batch, split across ranks")
    parser.add_argument("--sequence", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    torch_pjrt.distributed.register()
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch_pjrt.distributed.local_device()
    torch.pjrt.set_device(device)

    torch.manual_seed(0)
    model = DistributedDataParallel(GPT(context=args.sequence).to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    data = batches(corpus_bytes(), args.batch, args.sequence, args.steps)
    train_on_ranks(model, optimizer, data, device)
    if rank == 0:
        print(f"{world} ranks on {dist.get_backend()} / {device}: done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

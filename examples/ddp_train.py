"""Data-parallel training of the small GPT on pjrt devices with DistributedDataParallel.

Run: torchrun --nproc-per-node 2 examples/ddp_train.py
(add TORCH_PJRT_CPU_DEVICES=2 to give each CPU process two devices: rank r then uses pjrt:r).
Every rank trains on its own slice of each batch; DDP averages the gradients in buckets over
the "pjrt" c10d backend, so every rank ends each step with the same weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from gpt import GPT, batches, corpus_bytes, join_process_group, rank_arguments, train_on_ranks
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = rank_arguments(__doc__)
    args = parser.parse_args()
    rank, world, device = join_process_group()

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

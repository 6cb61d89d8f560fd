"""Fully sharded training (FSDP2, `fully_shard`) of the small GPT on pjrt devices.

Run: torchrun --nproc-per-node 2 examples/fsdp_train.py [--bf16]
Each rank holds a 1/world shard of every parameter and optimizer state; blocks all-gather
their weights before use and reduce-scatter their gradients after. With --bf16 the forward and
backward run in bfloat16 (MixedPrecisionPolicy) while the sharded weights and the gradient
reduction stay in float32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from gpt import GPT, batches, corpus_bytes, join_process_group, rank_arguments, train_on_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def main() -> None:
    parser = rank_arguments(__doc__)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 compute, float32 reduction")
    args = parser.parse_args()
    rank, world, device = join_process_group()
    mesh = init_device_mesh("pjrt", (world,))

    torch.manual_seed(0)
    model = GPT(context=args.sequence).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else (
        MixedPrecisionPolicy())
    for block in model.modules():
        if type(block).__name__ == "Block":
            fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    data = batches(corpus_bytes(), args.batch, args.sequence, args.steps)
    train_on_ranks(model, optimizer, data, device)
    if rank == 0:
        shard = next(model.parameters()).to_local()
        print(f"{world} ranks, FSDP2 on {device}: done (rank 0 holds {tuple(shard.shape)} of the embedding)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

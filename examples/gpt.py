"""A small GPT and a text corpus that every CPython install ships (pydoc's topic help)."""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn


def corpus_bytes() -> torch.Tensor:
    """The topic help texts of CPython's pydoc_data as a byte tensor (no download)."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[name] for name in sorted(topics.topics))
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def batches(
    data: torch.Tensor, batch: int, sequence: int, steps: int, seed: int = 0
) -> list[tuple[torch.Tensor, ...]]:
    """Fixed random windows of the corpus: inputs and next-byte targets."""
    generator = torch.Generator().manual_seed(seed)
    found = []
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - sequence - 1, (batch,), generator=generator)
        window = torch.stack([data[s : s + sequence + 1] for s in starts.tolist()])
        found.append((window[:, :-1].contiguous(), window[:, 1:].contiguous()))
    return found


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, sequence, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        shape = (batch, sequence, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, sequence, width))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 256, width: int = 128, layers: int = 2, heads: int = 4, context: int = 64) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        for parameter in self.parameters():
            if parameter.dim() > 1:
                nn.init.normal_(parameter, std=1.0 / math.sqrt(parameter.shape[-1]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_fn(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model, tokens, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.detach()


def rank_arguments(description: str) -> argparse.ArgumentParser:
    """The options every distributed example takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="global batch, split across ranks")
    parser.add_argument("--sequence", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    return parser


def join_process_group() -> tuple[int, int, torch.device]:
    """Join the torchrun job as ordinary PyTorch code does; each rank takes its local pjrt device."""
    import torch.distributed as dist

    import torch_pjrt.distributed

    dist.init_process_group()
    device = torch_pjrt.distributed.local_device()
    torch.pjrt.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def train_on_ranks(model: nn.Module, optimizer: torch.optim.Optimizer, data: list, device: torch.device) -> None:
    """Each rank trains on its slice of every batch; rank 0 prints the mean loss and the step time."""
    import time

    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    for step, (tokens, targets) in enumerate(data):
        start = time.perf_counter()
        local = tokens.chunk(world)[rank].to(device), targets.chunk(world)[rank].to(device)
        loss = train_step(model, optimizer, *local).detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}  {1000 * (time.perf_counter() - start):7.1f} ms")

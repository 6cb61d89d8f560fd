"""One rank of a pipeline-parallel test job: a small transformer in two stages, one per rank.

Launched by tests/test_pipelining.py with torchrun's environment. Usage:
pipeline_worker.py OUT_DIR SCENARIO[,SCENARIO...]. Each rank writes OUT_DIR/rank{R}.json:
{scenario: "ok" | error text}. Rank r holds stage r on pjrt:r; both ranks also train the whole
model on CPU, from the same seed and batches, as the reference.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

SEED = 4321
VOCAB, DIM, HEADS, SEQ, BLOCKS = 32, 16, 2, 8, 4
BATCH, MICROBATCHES, STEPS = 8, 4, 3
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class Block(nn.Module):
    """A pre-norm causal self-attention and MLP block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        attention = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, seq, DIM))
        return x + self.mlp(self.norm2(x))


class Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))


class Transformer(nn.Module):
    """Embeddings, blocks and head; `stage(i)` is the i-th of two halves (sharing its parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = Embedding()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.stage(1)(self.stage(0)(ids))

    def stage(self, index: int) -> nn.Sequential:
        half = BLOCKS // 2
        if index == 0:
            return nn.Sequential(self.embedding, *self.blocks[:half])
        return nn.Sequential(*self.blocks[half:], self.norm, self.head)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random token ids and next-token targets, the same on every rank."""
    generator = torch.Generator().manual_seed(SEED)
    ids = [torch.randint(VOCAB, (BATCH, SEQ + 1), generator=generator) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in ids]


def fresh_model() -> Transformer:
    torch.manual_seed(SEED)
    return Transformer()


def optimizer(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=0.2, momentum=0.9)


def reference() -> tuple[list[torch.Tensor], Transformer]:
    """The whole model trained in one process on CPU: per-microbatch losses of each step, final model."""
    model = fresh_model()
    opt = optimizer(model)
    losses = []
    for ids, targets in batches():
        opt.zero_grad()
        step = [loss_fn(model(x), y) for x, y in zip(ids.chunk(MICROBATCHES), targets.chunk(MICROBATCHES))]
        torch.stack(step).mean().backward()
        opt.step()
        losses.append(torch.stack(step).detach())
    return losses, model


def pipelined(schedule_class: type, device: torch.device, fail_at: int | None = None) -> tuple[list, nn.Module]:
    """This rank's stage trained with the schedule; the last stage returns its microbatch losses."""
    rank = dist.get_rank()
    module = fresh_model().stage(rank).to(device)
    if fail_at is not None and rank == 1:
        module.register_forward_hook(_fail_on_call(fail_at))
    stage = PipelineStage(module, rank, dist.get_world_size(), device)
    schedule = schedule_class(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    opt = optimizer(module)
    losses = []
    for ids, targets in batches():
        opt.zero_grad()
        if rank == 0:
            schedule.step(ids.to(device))
        else:
            step: list[torch.Tensor] = []
            schedule.step(target=targets.to(device), losses=step)
            losses.append(torch.stack([loss.detach().cpu() for loss in step]))
        opt.step()
    return losses, module


def _fail_on_call(call: int) -> object:
    calls = []

    def hook(*_: object) -> None:
        calls.append(1)
        if len(calls) == call:
            raise RuntimeError("injected failure in the last stage's forward")

    return hook


def check_training(schedule: str, device: torch.device) -> None:
    """The stage's losses and parameters equal the single-process CPU run's (float32 tolerances)."""
    losses, module = pipelined(SCHEDULES[schedule], device)
    expected_losses, model = reference()
    if dist.get_rank() == 1:
        torch.testing.assert_close(torch.stack(losses), torch.stack(expected_losses),
                                   msg=lambda m: f"{schedule} losses: {m}")
    expected = dict(model.stage(dist.get_rank()).named_parameters())
    for name, parameter in module.named_parameters():
        assert parameter.device == device, f"{schedule} {name} on {parameter.device}, expected {device}"
        torch.testing.assert_close(parameter.detach().cpu(), expected[name].detach(), atol=1e-5, rtol=1.3e-6,
                                   msg=lambda m, name=name: f"{schedule} {name}: {m}")


def scenario_gpipe(device: torch.device) -> None:
    check_training("gpipe", device)


def scenario_1f1b(device: torch.device) -> None:
    check_training("1f1b", device)


def scenario_exchange(device: torch.device) -> None:
    """Both ranks send before they receive in one batch_isend_irecv (1F1B's steady state), into a leaf
    that requires grad and a non-contiguous view; each gets its peer's random values."""
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    mine, theirs = (torch.randn(4, 6, generator=torch.Generator().manual_seed(SEED + r)) for r in (rank, peer))
    leaf = torch.empty(4, 6, device=device, requires_grad=True)
    base = torch.randn(6, 6)
    on_device = base.to(device)
    ops = [dist.P2POp(dist.isend, mine.to(device), peer), dist.P2POp(dist.isend, mine.to(device).t(), peer),
           dist.P2POp(dist.irecv, leaf, peer), dist.P2POp(dist.irecv, on_device[:, 1:5], peer)]
    works = dist.batch_isend_irecv(ops)
    for work in works[:3]:
        work.wait()
    assert works[3].get_future().value()[0] is ops[3].tensor, "a receive's future holds its tensor"
    torch.testing.assert_close(leaf.detach().cpu(), theirs, msg=lambda m: f"leaf: {m}")
    assert leaf.requires_grad and leaf.grad_fn is None, "the receive left the leaf a leaf"
    base[:, 1:5] = theirs.t()
    torch.testing.assert_close(on_device.cpu(), base, msg=lambda m: f"view written through its base: {m}")


def scenario_fail(device: torch.device) -> None:
    """Rank 1 raises in its second forward and stays alive; rank 0's schedule fails within the timeout."""
    limit = float(os.environ["DIST_TIMEOUT"])
    start = time.monotonic()
    try:
        pipelined(Schedule1F1B, device, fail_at=2)
    except RuntimeError as error:
        if dist.get_rank() == 1:
            assert "injected failure" in str(error.__cause__), f"rank 1 failed otherwise: {error}"
            time.sleep(limit + 3)
            return
        # The time includes the schedule's first steps and their compiles (9.4 s at load 10 on 2 cores); a hang
        # would last until the launcher's 90 s.
        elapsed = time.monotonic() - start
        assert elapsed < limit + 20, f"rank 0 failed only after {elapsed:.1f}s (timeout {limit}s): {error}"
        return
    raise AssertionError("the schedule completed although rank 1 raised")


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")}


if __name__ == "__main__":
    from ranks import run_scenarios

    run_scenarios(SCENARIOS, sys.argv[1], sys.argv[2])

"""The main job: train a small GPT on pjrt and on CPU side by side, and compare.

Both start from the same weights and see the same batches of CPython's pydoc topic
texts; the script prints both loss curves, their largest difference and the time
per step of each.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from gpt import GPT, batches, corpus_bytes, train_step


def train(model: torch.nn.Module, device: str, data: list, lr: float) -> tuple[list[float], list[float]]:
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses, seconds = [], []
    for tokens, targets in data:
        start = time.perf_counter()
        loss = train_step(model, optimizer, tokens.to(device), targets.to(device))
        losses.append(loss.item())
        seconds.append(time.perf_counter() - start)
    return losses, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sequence", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    torch.manual_seed(0)
    corpus = corpus_bytes()
    data = batches(corpus, args.batch, args.sequence, args.steps)
    model = GPT(context=args.sequence)
    print(f"corpus: {corpus.numel():,} bytes of pydoc topics; model: {sum(p.numel() for p in model.parameters()):,} "
          f"parameters; {args.steps} AdamW steps of batch {args.batch} x {args.sequence}")

    pjrt_losses, pjrt_seconds = train(copy.deepcopy(model), "pjrt", data, args.lr)
    cpu_losses, cpu_seconds = train(copy.deepcopy(model), "cpu", data, args.lr)

    print(f"\n{'step':>4} {'loss pjrt':>10} {'loss cpu':>10} {'diff':>9}")
    for step, (a, b) in enumerate(zip(pjrt_losses, cpu_losses)):
        print(f"{step:>4} {a:>10.5f} {b:>10.5f} {abs(a - b):>9.2e}")
    largest = max(abs(a - b) for a, b in zip(pjrt_losses, cpu_losses))
    steady = slice(3, None) if args.steps > 5 else slice(None)

    def median(values: list[float]) -> float:
        ordered = sorted(values[steady])
        return ordered[len(ordered) // 2]

    print(f"\nlargest loss difference pjrt vs cpu: {largest:.2e}")
    print(f"first step (includes compiles): pjrt {pjrt_seconds[0]:.2f} s, cpu {cpu_seconds[0]:.3f} s")
    print(f"median step after warm-up:      pjrt {median(pjrt_seconds) * 1e3:.1f} ms, "
          f"cpu {median(cpu_seconds) * 1e3:.1f} ms")
    print(f"device: {torch.pjrt.get_device_name()} ({torch.pjrt.get_device_properties().platform}), "
          f"eager mode {torch.pjrt.eager_mode.name}")


if __name__ == "__main__":
    main()

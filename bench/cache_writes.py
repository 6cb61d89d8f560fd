"""A KV-cache write into a view of one large buffer: pjrt strict eager against torch on CPU.

vLLM (and any cache kept as views of one allocation) writes each step's keys and values with
`cache_view[:, slots] = values` (index_put_ into a view). On CPU that touches only the written
elements; on pjrt the op is a scatter into the storage's whole array, so the figure that matters is
how the cost grows with the buffer: it should not (the scatter runs in place on the donated buffer).
Buffers of 1, 16 and 64 MiB, 64 slots written per call into one of two views (half the buffer each),
and the same write into a whole tensor of the same size for reference. All side by side in one run,
rounds interleaved, each figure the best round (this machine is shared and noisy).
Run: .venv/bin/python bench/cache_writes.py [--rounds N]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import torch_pjrt  # noqa: F401  (registers the device)

SLOTS = 64
HEADS = 4
CALLS = 40


def writer(device: str, mib: int, into_view: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    """(one write, a wait for the writes so far) on `device`."""
    slots_per_view = (mib << 20) // 4 // 2 // HEADS
    buffer = torch.zeros(2, HEADS, slots_per_view, device=device)
    target = buffer[1] if into_view else torch.zeros(HEADS, 2 * slots_per_view, device=device)
    slots = torch.randperm(slots_per_view)[:SLOTS].to(device)
    values = torch.randn(HEADS, SLOTS, device=device)

    def write() -> None:
        target[:, slots] = values

    def wait() -> None:
        target[0, 0].item()

    return write, wait


def per_write_us(write: Callable[[], None], wait: Callable[[], None]) -> float:
    wait()
    start = time.perf_counter()
    for _ in range(CALLS):
        write()
    wait()
    return (time.perf_counter() - start) / CALLS * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cases = [(mib, into_view) for mib in (1, 16, 64) for into_view in (True, False)]
    runs = {(case, device): writer(device, *case) for case in cases for device in ("cpu", "pjrt")}
    for write, wait in runs.values():  # compile and warm every program first
        for _ in range(3):
            write()
        wait()
    best = {key: float("inf") for key in runs}
    for _ in range(args.rounds):
        for key, (write, wait) in runs.items():
            best[key] = min(best[key], per_write_us(write, wait))
    print(f"| buffer MiB | written into | torch CPU us | pjrt us | pjrt / CPU |  ({SLOTS} slots x {HEADS} heads)")
    print("|---|---|---|---|---|")
    for mib, into_view in cases:
        cpu, pjrt = best[((mib, into_view), "cpu")], best[((mib, into_view), "pjrt")]
        where = "a view of half the buffer" if into_view else "a whole tensor"
        print(f"| {mib} | {where} | {cpu:.1f} | {pjrt:.1f} | {pjrt / cpu:.2f} |")


if __name__ == "__main__":
    main()

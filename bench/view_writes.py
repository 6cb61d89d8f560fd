"""In-place writes into part of a large buffer: through a view of the buffer's dtype and of another one.

A KV-cache-like write: `index_put_` of 8 rows of 64 float32 values into a layer's part of one buffer of
4, 64 or 256 MiB, the buffer either float32 or int8 viewed as float32 (vLLM allocates its caches so).
Both should cost what the write costs, not what the buffer costs. Strict eager; the two buffers run in
interleaved rounds, best round kept (fastest mean of --calls calls); each row also checks the written rows.
Run: .venv/bin/python bench/view_writes.py [--rounds N] [--calls K]
"""

from __future__ import annotations

import argparse
import time

import torch

import torch_pjrt  # noqa: F401 (the pjrt device)


def layer_view(mib: int, reinterpreted: bool) -> torch.Tensor:
    """A (rows, 64) float32 view of the second quarter of a buffer of `mib` MiB."""
    nbytes = mib << 20
    if reinterpreted:
        return torch.zeros(nbytes, dtype=torch.int8, device="pjrt").view(torch.float32)[nbytes // 16 : nbytes // 8] \
            .view(-1, 64)
    return torch.zeros(nbytes // 4, dtype=torch.float32, device="pjrt")[nbytes // 16 : nbytes // 8].view(-1, 64)


def mean_ms(view: torch.Tensor, calls: int) -> float:
    rows = torch.randint(0, view.shape[0], (8,)).to("pjrt")
    values = torch.randn(8, 64).to("pjrt")
    view.index_put_((rows,), values)  # the compile
    torch.pjrt.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        view.index_put_((rows,), values)
    torch.pjrt.synchronize()
    elapsed = (time.perf_counter() - start) / calls * 1e3
    if not torch.equal(view[rows].cpu(), values.cpu()):
        raise RuntimeError("the written rows differ from the values")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    print(f"index_put_ of 8 x 64 float32 rows; best of {args.rounds} interleaved rounds, mean of {args.calls} calls")
    print(f"{'buffer MiB':>10}{'float32 buffer ms':>19}{'int8 buffer ms':>16}{'int8/float32':>14}")
    for mib in (4, 64, 256):
        views = {kind: layer_view(mib, kind == "int8") for kind in ("float32", "int8")}
        best = dict.fromkeys(views, float("inf"))
        for round_index in range(args.rounds):
            for kind in views if round_index % 2 == 0 else reversed(list(views)):
                best[kind] = min(best[kind], mean_ms(views[kind], args.calls))
        print(f"{mib:>10}{best['float32']:>19.2f}{best['int8']:>16.2f}{best['int8'] / best['float32']:>14.2f}")
        del views


if __name__ == "__main__":
    main()

"""Compile counts and seconds for a sweep of sequence lengths, with and without mark_dynamic.

Each row is a new process (empty compile cache) that runs the GPT of bench/train_step.py, compiled
with backend="pjrt", forward and backward of its loss at every length in the sweep, and counts
the graph programs XLA compiled (forward and backward graphs) and the small per-length programs
that copy an input into its bucket (none when the inputs are marked before they move to pjrt: they
are padded during the transfer). Without bounds Dynamo makes the length dynamic after the
second one and every new length compiles; `torch_pjrt.mark_dynamic(t, 1, min=1, max=128)` pads
to power-of-two buckets, so the graphs compile once per bucket (Dynamo specialises length 1).
Run: .venv/bin/python bench/dynamic_lengths.py [--lengths 1 128]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

CHILD = textwrap.dedent(
    """
    import json, sys, time, torch, torch_pjrt
    import torch.nn.functional as F
    sys.path.insert(0, {examples!r})
    from gpt import GPT
    torch.manual_seed(0)
    model = GPT(width=128, layers=2, heads=4, context={longest}).to("pjrt")

    def loss(tokens, targets):
        logits = model(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    compiled = torch.compile(loss, backend="pjrt")
    start = time.perf_counter()
    for length in range({first}, {longest} + 1):
        tokens, targets = (torch.randint(0, 256, (8, length)) for _ in range(2))
        if {bounded!r}:
            for t in (tokens, targets):
                torch_pjrt.mark_dynamic(t, 1, min=1, max={longest})
        compiled(tokens.to("pjrt"), targets.to("pjrt")).backward()
        torch.pjrt.synchronize()
    counters = torch_pjrt.metrics.counters()
    counters["wall_seconds"] = time.perf_counter() - start
    print(json.dumps(counters))
    """
)


def sweep(first: int, longest: int, bounded: bool) -> dict:
    examples = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
    code = CHILD.format(examples=examples, first=first, longest=longest, bounded=bounded)
    with tempfile.TemporaryDirectory() as cache:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                env={**os.environ, "TORCH_PJRT_CACHE_DIR": cache})
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", nargs=2, type=int, default=(1, 128), metavar=("FIRST", "LAST"))
    first, longest = parser.parse_args().lengths
    print(f"GPT loss forward+backward, torch.compile(backend='pjrt'), lengths {first}..{longest}")
    print(f"{'':<34}{'graph compiles':>15}{'graph s':>9}{'pad compiles':>13}{'pad s':>7}{'sweep s':>9}")
    for label, bounded in (("no mark_dynamic", False), (f"mark_dynamic(min=1, max={longest})", True)):
        c = sweep(first, longest, bounded)
        print(f"{label:<34}{c['graph_compiles']:>15}{c['graph_compiles_seconds']:>9.1f}"
              f"{c['pad_compiles']:>13}{c['pad_compiles_seconds']:>7.1f}{c['wall_seconds']:>9.1f}")


if __name__ == "__main__":
    main()

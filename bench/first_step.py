"""Time to first step of a fresh process, cold compile cache against warm, side by side.

Each row is a new Python process that imports torch, builds the GPT of bench/train_step.py and runs
one training step (compiled with backend="pjrt", or in strict eager), timed from before `import torch`
to the step's loss on the host. Cold: an empty TORCH_PJRT_CACHE_DIR; warm: the same folder again.
Run: .venv/bin/python bench/first_step.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

CHILD = textwrap.dedent(
    """
    import time
    start = time.perf_counter()
    import sys, torch
    sys.path.insert(0, {examples!r})
    from gpt import GPT, batches, corpus_bytes, train_step
    torch.manual_seed(0)
    model = GPT(width=128, layers=2, heads=4, context=64).to("pjrt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens, targets = batches(corpus_bytes(), 8, 64, 1)[0]
    step = train_step
    if {compiled!r}:
        step = torch.compile(train_step, backend="pjrt")
    loss = step(model, optimizer, tokens.to("pjrt"), targets.to("pjrt")).item()
    seconds = time.perf_counter() - start
    import torch_pjrt
    counters = torch_pjrt.metrics.counters()
    print(seconds, counters["persistent_cache_hits"], counters["disk_store_hits"])
    """
)


def first_step(cache: str, compiled: bool) -> tuple[float, int, int]:
    """Seconds to the first step's loss, XLA executables and traced graphs read from the cache."""
    examples = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
    code = CHILD.format(examples=examples, compiled=compiled)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "TORCH_PJRT_CACHE_DIR": cache})
    seconds, executables, graphs = result.stdout.split()[-3:]
    return float(seconds), int(executables), int(graphs)


def main() -> None:
    print(f"{'first training step of a new process':<40}{'cold s':>9}{'warm s':>9}{'warm/cold':>11}"
          f"{'warm hits: executables':>24}{'graphs':>8}")
    for label, compiled in (("torch.compile(backend='pjrt')", True), ("strict eager", False)):
        with tempfile.TemporaryDirectory() as cache:
            cold, _, _ = first_step(cache, compiled)
            warm, executables, graphs = first_step(cache, compiled)
        print(f"{label:<40}{cold:>9.2f}{warm:>9.2f}{warm / cold:>11.2f}{executables:>24}{graphs:>8}")
    print("goal (compiled): warm at most half of cold")


if __name__ == "__main__":
    main()

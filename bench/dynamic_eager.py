"""Variable shapes in eager: compiles and wall time with and without mark_dynamic, against torch CPU.

Two workloads, each row a new process (empty compile cache) timed against torch CPU eager on the
same weights and inputs in that process:
- generate: Hugging Face `generate()` of a 4-layer Llama (width 128, random weights), greedy, 8 new
  tokens, two warm-up prompts (lengths 7 and 11), then 12 new prompt lengths 5..60. Columns: programs
  compiled over the 12 (and per length), seconds for the 12 on pjrt (each prompt's one run: its
  compiles are the point) and on CPU (each prompt's best of 3, run just before), and whether every
  token equals CPU's. Marks: none (TORCH_PJRT_DYNAMIC_GENERATE=0), automatic (generate() marks the
  prompt itself: buckets 64, 128, 256), or the user's `torch_pjrt.mark_dynamic(ids, 1, max=128,
  buckets=[64, 128])` (and the mask) before `generate`. The last two rows run the sweep a second time
  with the persistent compile cache of the first run (what a user's second session sees); compiles
  then count executables loaded from it.
- train: the GPT of examples/gpt.py (batch 4), SGD, 12 steps over sequence lengths 16..128, in strict,
  fused and compiled (`torch.compile(loss_fn, backend="pjrt")`, backward through AOTAutograd); programs
  compiled after the first step of each bucket, and the largest loss difference from CPU.
- compiled: that GPT's forward under torch.compile(backend="pjrt") over 43 lengths 2..128, every
  program compiled (graphs, pads, slices, eager ops) counted, and the largest difference from CPU.
Run: .venv/bin/python bench/dynamic_eager.py [--only generate|train|compiled]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

# this folder, where the subprocesses import tiny_llama from
BENCH = os.path.dirname(os.path.abspath(__file__))

GENERATE = textwrap.dedent(
    """
    import json, sys, time, warnings, torch, torch_pjrt
    from transformers import StaticCache
    warnings.simplefilter("ignore")
    mode, marks, cache = {mode!r}, {marks!r}, {cache!r}
    if mode == "fused":
        torch.pjrt.set_eager_mode(torch_pjrt.EagerMode.DEFER_AND_FUSE)
    sys.path.insert(0, {bench!r})
    from tiny_llama import cpu_and_pjrt_llama
    cpu, pjrt = cpu_and_pjrt_llama()
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)

    def generate(model, ids, device):
        mask = torch.ones_like(ids)
        if device == "pjrt" and marks not in ("none", "automatic"):
            buckets = None if marks == "powers of two" else [64, 128]
            for t in (ids, mask):
                torch_pjrt.mark_dynamic(t, 1, max=128, buckets=buckets)
        extra = {{}}
        if cache == "static":  # one cache length for every prompt, as a server would set it
            extra["past_key_values"] = StaticCache(config=model.config, max_cache_len=128)
        with torch.no_grad():
            return model.generate(ids.to(device), attention_mask=mask.to(device), **options, **extra).cpu()

    def programs():
        # XLA compiles (a fused program compiled counts there too), and fused programs loaded from the
        # cache folder (new fused programs that jax never traced)
        counts = torch_pjrt.metrics.counters()
        return counts["compiles"] + counts["fused_compiles"] - counts["fused_traces"]

    row = dict(cpu_s=0.0, pjrt_s=0.0, compiles=0, equal=True, lengths={{}})
    generator = torch.Generator().manual_seed(1)
    for index, length in enumerate([7, 11] + list(range(5, 61, 5))):
        ids = torch.randint(1, 256, (1, length), generator=generator)
        cpu_seconds = []
        for _ in range(3):  # CPU's best of 3: a loaded machine slows torch's threads most
            start = time.perf_counter()
            want = generate(cpu, ids.clone(), "cpu")
            cpu_seconds.append(time.perf_counter() - start)
        middle = time.perf_counter()
        before = programs()
        got = generate(pjrt, ids.clone(), "pjrt")
        end = time.perf_counter()
        if index >= 2:
            row["cpu_s"] += min(cpu_seconds)
            row["pjrt_s"] += end - middle
            row["compiles"] += programs() - before
            row["equal"] = row["equal"] and torch.equal(want, got)
            row["lengths"][length] = (end - middle, programs() - before, min(cpu_seconds))
    row["unmaskable"] = torch_pjrt.metrics.counters()["dynamic_unmaskable"]
    print(json.dumps(row))
    """
)

TRAIN = textwrap.dedent(
    """
    import json, sys, time, warnings, torch, torch_pjrt
    sys.path.insert(0, {examples!r})
    from gpt import GPT, loss_fn
    warnings.simplefilter("ignore")
    mode, marks = {mode!r}, {marks!r}
    torch.manual_seed(0)
    cpu = GPT(width=64, layers=2, heads=4, context=128)
    pjrt = GPT(width=64, layers=2, heads=4, context=128)
    pjrt.load_state_dict(cpu.state_dict())
    pjrt = pjrt.to("pjrt")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (cpu, pjrt)]
    context = torch.pjrt.set_eager_mode("defer_and_fuse" if mode == "fused" else "defer_never")
    # compiled: the forward and loss as one torch.compile(backend="pjrt") graph, its backward AOTAutograd's
    step_loss = torch.compile(loss_fn, backend="pjrt") if mode == "compiled" else loss_fn

    def programs():
        counts = torch_pjrt.metrics.counters()
        return counts["compiles"] + counts["fused_compiles"]

    row = dict(cpu_s=0.0, pjrt_s=0.0, compiles_after_first=0, worst_loss_difference=0.0)
    generator = torch.Generator().manual_seed(1)
    lengths = [16, 128, 37, 100, 64, 23, 90, 50, 120, 30, 77, 45]
    seen = set()
    with context:
        for length in lengths:
            tokens, targets = (torch.randint(0, 256, (4, length), generator=generator) for _ in range(2))
            start = time.perf_counter()
            want = loss_fn(cpu, tokens, targets)
            want.backward()
            optimizers[0].step()
            optimizers[0].zero_grad()
            middle = time.perf_counter()
            before = programs()
            if marks != "none":
                for t in (tokens, targets):
                    torch_pjrt.mark_dynamic(t, 1, max=128)
            got = step_loss(pjrt, tokens.to("pjrt"), targets.to("pjrt"))
            got.backward()
            optimizers[1].step()
            optimizers[1].zero_grad()
            got = got.item()
            end = time.perf_counter()
            bucket = 1 << (length - 1).bit_length()
            if bucket in seen:
                row["compiles_after_first"] += programs() - before
                row["cpu_s"] += middle - start
                row["pjrt_s"] += end - middle
            seen.add(bucket)
            row["worst_loss_difference"] = max(row["worst_loss_difference"], abs(got - want.item()))
    row["buckets"] = len(seen)
    print(json.dumps(row))
    """
)


COMPILED = textwrap.dedent(
    """
    import json, sys, time, warnings, torch, torch_pjrt
    sys.path.insert(0, {examples!r})
    from gpt import GPT
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    cpu = GPT(width=64, layers=2, heads=4, context=128)
    pjrt = GPT(width=64, layers=2, heads=4, context=128)
    pjrt.load_state_dict(cpu.state_dict())
    forward = torch.compile(pjrt.to("pjrt"), backend="pjrt")
    counts = torch_pjrt.metrics.counters
    before = counts()["compiles"]
    worst = 0.0
    start = time.perf_counter()
    for length in range(2, 129, 3):
        tokens = torch.randint(0, 256, (2, length))
        if {marks!r}:
            torch_pjrt.mark_dynamic(tokens, 1, min=2, max=128)
        with torch.no_grad():
            got = forward(tokens.to("pjrt")).cpu()
        worst = max(worst, (got - cpu(tokens)).abs().max().item())
    print(json.dumps(dict(compiles=counts()["compiles"] - before, graph=counts()["graph_compiles"],
                          seconds=time.perf_counter() - start, worst=worst)))
    """
)


def run(code: str, **env_vars: str) -> dict:
    env = {**os.environ, "TORCH_PJRT_CACHE_DIR": "0", **env_vars}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["generate", "train", "compiled"])
    only = parser.parse_args().only
    if only in (None, "generate"):
        print("generate(): 4-layer Llama, 8 new tokens, 12 new prompt lengths 5..60 after 2 warm-ups")
        print(f"{'mode':<8}{'cache':<9}{'marks':<30}{'compiles':>9}{'per length':>11}{'pjrt s':>8}"
              f"{'cpu s':>7}{'ratio':>7}  tokens equal")
        rows = [("strict", "dynamic", "none", False), ("strict", "dynamic", "automatic", False),
                ("strict", "dynamic", "64,128", False), ("strict", "static", "automatic", False),
                ("fused", "dynamic", "automatic", False), ("fused", "dynamic", "64,128", False),
                ("fused", "static", "64,128", False), ("strict", "dynamic", "automatic", True),
                ("fused", "dynamic", "automatic", True)]
        for mode, cache, marks, warm in rows:
            code = GENERATE.format(mode=mode, marks=marks, cache=cache, bench=BENCH)
            env = {"TORCH_PJRT_DYNAMIC_GENERATE": "0" if marks == "none" else "1"}
            with tempfile.TemporaryDirectory() as folder:
                if warm:  # a second run of the same sweep: XLA executables come from the persistent cache
                    env["TORCH_PJRT_CACHE_DIR"] = folder
                    run(code, **env)
                row = run(code, **env)
            marks = marks + " (warm disk cache)" if warm else marks
            print(f"{mode:<8}{cache:<9}{marks:<30}{row['compiles']:>9.0f}{row['compiles'] / 12:>11.1f}"
                  f"{row['pjrt_s']:>8.2f}{row['cpu_s']:>7.2f}{row['pjrt_s'] / row['cpu_s']:>7.1f}  {row['equal']}"
                  + (f" ({row['unmaskable']:.0f} unmaskable ops)" if row["unmaskable"] else ""), flush=True)
    if only in (None, "train"):
        examples = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
        print("\ntraining: GPT (batch 4), SGD, 12 steps at lengths 16..128 (5 power-of-two buckets)")
        print(f"{'mode':<10}{'marks':<16}{'compiles after a bucket first ran':>35}{'pjrt s':>8}{'cpu s':>7}"
              f"{'worst loss diff':>17}")
        for mode, marks in (("strict", "none"), ("strict", "max=128"), ("fused", "max=128"), ("compiled", "none"),
                            ("compiled", "max=128")):
            row = run(TRAIN.format(examples=examples, mode=mode, marks=marks))
            print(f"{mode:<10}{marks:<16}{row['compiles_after_first']:>35.0f}{row['pjrt_s']:>8.2f}"
                  f"{row['cpu_s']:>7.2f}{row['worst_loss_difference']:>17.2e}", flush=True)

    if only in (None, "compiled"):
        examples = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
        print("\ntorch.compile(backend='pjrt') GPT forward (batch 2), 43 lengths 2..128")
        print(f"{'marks':<28}{'programs compiled (all kinds)':>31}{'graph programs':>16}{'seconds':>9}"
              f"{'worst difference':>18}")
        for marks in (False, True):
            row = run(COMPILED.format(examples=examples, marks=marks))
            label = "mark_dynamic(max=128)" if marks else "none"
            print(f"{label:<28}{row['compiles']:>31.0f}{row['graph']:>16.0f}{row['seconds']:>9.1f}"
                  f"{row['worst']:>18.2e}", flush=True)


if __name__ == "__main__":
    main()

"""Hugging Face generate() tokens/s on pjrt (native path on and off, strict and fused) against torch CPU eager.

A 4-layer Llama (width 128) from a small config, greedy, 64 new tokens after a 16-token prompt, in
one process per row (TORCH_PJRT_NATIVE_DISPATCH=1 or 0, TORCH_PJRT_EAGER_MODE strict or
DEFER_AND_FUSE), each with its own torch CPU eager run on the
same weights: after one warm-up generate (the compiles), the best of a few timed generates, rounds
interleaved between CPU and pjrt. Tokens must equal CPU's. CPU is timed with torch's default threads and
with one thread: on a loaded machine torch's worker threads wait on each other, slowing CPU several
times over, which the one-thread column leaves out.
Run: .venv/bin/python bench/generate_tokens.py [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

# this folder, where the subprocesses import tiny_llama from
BENCH = os.path.dirname(os.path.abspath(__file__))

GENERATE = textwrap.dedent(
    """
    import json, sys, time, warnings, torch, torch_pjrt
    warnings.simplefilter("ignore")
    sys.path.insert(0, {bench!r})
    from tiny_llama import cpu_and_pjrt_llama
    cpu, pjrt = cpu_and_pjrt_llama()
    ids = torch.randint(1, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    options = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)

    def generate(model, device):
        with torch.no_grad():
            return model.generate(ids.to(device), attention_mask=torch.ones_like(ids).to(device), **options).cpu()

    want, got = generate(cpu, "cpu"), generate(pjrt, "pjrt")
    threads = torch.get_num_threads()
    best = dict(cpu=float("inf"), cpu_one_thread=float("inf"), pjrt=float("inf"))
    for _ in range({repeats}):
        for row, device, model in (("cpu", "cpu", cpu), ("cpu_one_thread", "cpu", cpu), ("pjrt", "pjrt", pjrt)):
            torch.set_num_threads(1 if row == "cpu_one_thread" else threads)
            start = time.perf_counter()
            generate(model, device)
            best[row] = min(best[row], time.perf_counter() - start)
    print(json.dumps(dict(cpu_tokens_per_s=64 / best["cpu"], cpu_one_thread_tokens_per_s=64 / best["cpu_one_thread"],
                          pjrt_tokens_per_s=64 / best["pjrt"], equal=torch.equal(want, got))))
    """
)


def run(native: str, mode: str, repeats: int) -> dict:
    env = {**os.environ, "TORCH_PJRT_CACHE_DIR": "0", "TORCH_PJRT_NATIVE_DISPATCH": native,
           "TORCH_PJRT_EAGER_MODE": mode}
    result = subprocess.run([sys.executable, "-c", GENERATE.format(repeats=repeats, bench=BENCH)], capture_output=True,
                            text=True, env=env)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    repeats = parser.parse_args().repeats
    print("generate(): 4-layer Llama (width 128), greedy, 16-token prompt, 64 new tokens")
    print(f"{'pjrt mode, dispatch':<36}{'pjrt tokens/s':>14}{'torch CPU tokens/s':>19}{'pjrt / CPU':>11}"
          f"{'CPU 1 thread':>13}{'pjrt / CPU 1 thread':>20}  tokens equal")
    for label, native, mode in (("strict, Python (native off)", "0", "defer_never"),
                                ("strict, native hit path", "1", "defer_never"),
                                ("DEFER_AND_FUSE, Python (native off)", "0", "defer_and_fuse"),
                                ("DEFER_AND_FUSE, native", "1", "defer_and_fuse")):
        row = run(native, mode, repeats)
        print(f"{label:<36}{row['pjrt_tokens_per_s']:>14.1f}{row['cpu_tokens_per_s']:>19.1f}"
              f"{row['pjrt_tokens_per_s'] / row['cpu_tokens_per_s']:>11.2f}{row['cpu_one_thread_tokens_per_s']:>13.1f}"
              f"{row['pjrt_tokens_per_s'] / row['cpu_one_thread_tokens_per_s']:>20.2f}  {row['equal']}", flush=True)


if __name__ == "__main__":
    main()

"""Hugging Face generate() tokens/s on pjrt (native path on and off, strict and fused) against torch CPU eager.

A 4-layer Llama (width 128) from a small config, greedy, 64 new tokens after a 16-token prompt, in
one process per row (TORCH_PJRT_NATIVE_DISPATCH=1 or 0, TORCH_PJRT_EAGER_MODE strict or
DEFER_AND_FUSE; generate()'s stop check read a token late, as torch_pjrt.integrations has it, and in the last
row after each token, as Hugging Face has it off mps), each with its own torch CPU eager run on the
same weights: after one warm-up generate (the compiles), the best of a few timed generates, rounds
interleaved between CPU and pjrt. Tokens must equal CPU's. CPU is timed with torch's default threads and
with one thread: on a loaded machine torch's worker threads wait on each other, slowing CPU several
times over, which the one-thread column leaves out. --breakdown then splits one more generate's
main-thread CPU time per token in each native row into the fused graph's flush (outside its program
call), the program call, reads to the host, and the rest (Hugging Face's Python, PyTorch's dispatcher and
our native per-op path), with ops, fused programs and native misses per token, our flush split (the earlier
programs' check codes read, the numbers passed, the replay match, the donation scan, the device-side checks issued,
the rest); and its wall time per token, of
which the reads to the host wait (off the CPU) for the program to finish: the device time the host does not
overlap, as each token's read needs that token's program.
Run: .venv/bin/python bench/generate_tokens.py [--repeats N] [--breakdown]
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
    if not {late_stop_check}:  # Hugging Face's own stop check: read after each token, waiting for its program
        import transformers.generation.utils as generation
        generation.DeferredStopCheck = generation.DeferredStopCheck.replaced
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
    result = dict(cpu_tokens_per_s=64 / best["cpu"], cpu_one_thread_tokens_per_s=64 / best["cpu_one_thread"],
                  pjrt_tokens_per_s=64 / best["pjrt"], equal=torch.equal(want, got))
    """
)

# Appended to GENERATE with --breakdown (not formatted): one more pjrt generate, its main-thread CPU split.
BREAKDOWN = textwrap.dedent(
    """
    from fused_parts import FLUSH_PARTS, timed_flush_parts
    from generate_compiled import CpuTimer
    from torch_pjrt.eager import dispatch, fusion
    from torch_pjrt.runtime import client, programs
    timers = dict(flush=CpuTimer(), program=CpuTimer(), read=CpuTimer(), miss=CpuTimer())
    part_timers = {name: CpuTimer() for name in FLUSH_PARTS}  # our flush's parts (bench/fused_parts.py)
    originals = (fusion.PendingGraph.flush, programs.Program.call, client.to_host_many, dispatch.native_miss)
    read_wall = [0.0]

    def read_timed(arrays):
        start = time.perf_counter()
        try:
            return originals[2](arrays)
        finally:
            read_wall[0] += time.perf_counter() - start

    fusion.PendingGraph.flush = timers["flush"].wrap(originals[0])
    programs.Program.call = timers["program"].wrap(originals[1], lambda self, *args: self.name.startswith("fused"))
    client.to_host_many = timers["read"].wrap(read_timed)
    dispatch.native_miss = timers["miss"].wrap(originals[3])
    before = torch_pjrt.metrics.counters()
    with timed_flush_parts(lambda name, fn: part_timers[name].wrap(fn)):
        start, wall = time.thread_time(), time.perf_counter()
        generate(pjrt, "pjrt")
        total, wall = time.thread_time() - start, time.perf_counter() - wall
    (fusion.PendingGraph.flush, programs.Program.call, client.to_host_many, dispatch.native_miss) = originals
    after = torch_pjrt.metrics.counters()
    flush, program, read = (timers[name].seconds for name in ("flush", "program", "read"))
    # (a fused program is called inside its flush; the flush runs before a read, not inside it)
    parts = dict(all=total, flush_outside_program_call=flush - program, program_calls=program, reads_to_host=read,
                 rest=total - flush - read)
    result["breakdown_ms_per_token"] = {name: seconds * 1000 / 64 for name, seconds in parts.items()}
    ours = {name: timer.seconds for name, timer in part_timers.items()}
    ours["the rest"] = flush - program - sum(ours.values())
    result["flush_parts_ms_per_token"] = {name: seconds * 1000 / 64 for name, seconds in ours.items()}
    result["wall_ms_per_token"] = dict(all=wall * 1000 / 64, reads_waiting=(read_wall[0] - read) * 1000 / 64)
    result["per_token"] = dict(ops=(after["ops_executed"] - before["ops_executed"]) / 64,
                               fused_programs=(after["fused_programs"] - before["fused_programs"]) / 64,
                               native_misses=timers["miss"].calls / 64)
    """
)


def run(native: str, mode: str, repeats: int, breakdown: bool = False, late_stop_check: bool = True) -> dict:
    env = {**os.environ, "TORCH_PJRT_CACHE_DIR": "0", "TORCH_PJRT_NATIVE_DISPATCH": native,
           "TORCH_PJRT_EAGER_MODE": mode}
    code = GENERATE.format(repeats=repeats, bench=BENCH, late_stop_check=late_stop_check)
    code += BREAKDOWN if breakdown else ""
    code += "print(json.dumps(result))\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--breakdown", action="store_true",
                        help="split one more generate's main-thread CPU per token in the native rows")
    args = parser.parse_args()
    print("generate(): 4-layer Llama (width 128), greedy, 16-token prompt, 64 new tokens")
    print(f"{'pjrt mode, dispatch':<36}{'pjrt tokens/s':>14}{'torch CPU tokens/s':>19}{'pjrt / CPU':>11}"
          f"{'CPU 1 thread':>13}{'pjrt / CPU 1 thread':>20}  tokens equal")
    for label, native, mode, late in (("strict, Python (native off)", "0", "defer_never", True),
                                      ("strict, native hit path", "1", "defer_never", True),
                                      ("DEFER_AND_FUSE, Python (native off)", "0", "defer_and_fuse", True),
                                      ("DEFER_AND_FUSE, native", "1", "defer_and_fuse", True),
                                      ("  the same, stop read each token", "1", "defer_and_fuse", False)):
        row = run(native, mode, args.repeats, args.breakdown and native == "1", late)
        print(f"{label:<36}{row['pjrt_tokens_per_s']:>14.1f}{row['cpu_tokens_per_s']:>19.1f}"
              f"{row['pjrt_tokens_per_s'] / row['cpu_tokens_per_s']:>11.2f}{row['cpu_one_thread_tokens_per_s']:>13.1f}"
              f"{row['pjrt_tokens_per_s'] / row['cpu_one_thread_tokens_per_s']:>20.2f}  {row['equal']}", flush=True)
        if "breakdown_ms_per_token" in row:
            parts = row["breakdown_ms_per_token"]
            print(f"    main-thread CPU ms per token (load {open('/proc/loadavg').read().split()[0]}): all "
                  f"{parts['all']:.3f} = flush outside its program call {parts['flush_outside_program_call']:.3f} + "
                  f"fused program calls {parts['program_calls']:.3f} + reads to host {parts['reads_to_host']:.3f} + "
                  f"the rest {parts['rest']:.3f}; per token: ops {row['per_token']['ops']:.1f}, fused programs "
                  f"{row['per_token']['fused_programs']:.2f}, native misses {row['per_token']['native_misses']:.2f}",
                  flush=True)
            if row["per_token"]["fused_programs"]:
                print("    our flush per token (ms): " + ", ".join(
                    f"{name} {ms:.3f}" for name, ms in row["flush_parts_ms_per_token"].items()), flush=True)
            wall = row["wall_ms_per_token"]
            print(f"    wall ms per token: {wall['all']:.3f}, of which reads to host waiting off the CPU (for the "
                  f"program, or for the CPU) {wall['reads_waiting']:.3f}", flush=True)


if __name__ == "__main__":
    main()

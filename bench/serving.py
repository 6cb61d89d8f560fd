"""vLLM offline serving: the pjrt platform plugin (eager and compiled) against vLLM's CPU platform (eager).

A 2-layer Llama (width 128, head_dim 32) with random weights saved to a temporary folder; N requests of
mixed prompt lengths (8, 17, ..., 53 tokens, repeating past 6 requests, each prompt's tokens its own)
submitted at once (`LLM.generate` on prompt token ids, greedy, `--new-tokens` each: `ignore_eos`, as vLLM's own
throughput benchmark, so no logits processor acts; with `min_tokens`, as before 2026-12-06 noon, vLLM's
min-tokens processor masked the stop tokens' logits every step, and the pjrt runner samples on the host).
Each row is its own process (vLLM picks its platform once per process: `VLLM_PLUGINS=` with no name
leaves vLLM's CPU platform); after one warm-up batch (the compiles), the best of `--repeats` timed batches
(the second batch meets new token buckets, as prefix caching shortens its prefills; the third compiles nothing),
and the time to first token: the same N requests with prompts not seen before and one new token each
(the batch's prefill and first sampling). "compiled" rows pass enforce_eager=False: vLLM's compile path, the
model's graph (attention inside it) one program a step, compiled by the pjrt backend per (token, context)
bucket; the rest of the step (sampling) runs in the eager mode named. vLLM's CPU platform turns vLLM's
async scheduling off, and so do the pjrt rows (TORCH_PJRT_VLLM_ASYNC_SCHEDULING=0), like for like, except
"compiled-async", the pjrt platform's default (the engine schedules step N+1 while the device runs step N).
The rows run interleaved, `--rounds` times (a fresh process each), and each row keeps its best round, so a
busy spell on a shared machine hits every row alike. Output tokens must equal across rows and rounds. Needs
the vLLM environment: `make test-serving` builds it.
With `--profile`, each pjrt row also prints torch.profiler's table of one more batch (docs/profiler.md). With
`--breakdown`, every row times one more batch phase by phase (vLLM's scheduler, the runner's input
preparation, attention metadata, forward, logits, sampling; in pjrt rows also our metadata build, the forward's
program calls made from Python, its copies to the host, which wait for the programs, and under async scheduling
the step's tokens read when the engine takes its output) and a table of wall ms per engine step
follows, with the CPU ms per step of the process's threads: the engine's thread and the others (XLA's, which
run the programs, or vLLM CPU's OpenMP threads), and the engine thread's time runnable but waiting for a core.
Run: .venv-vllm/bin/python bench/serving.py [--requests N] [--new-tokens T] [--repeats R] [--rounds K]
     [--kv-cache-mib M] [--profile | --breakdown] [--sampling auto|device|host] [--rows cpu,strict,fused,...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

SERVE = textwrap.dedent(
    """
    import json, resource, sys, time
    from collections import defaultdict

    # the calling thread's time spent runnable but waiting for a core (Linux schedstat; 0 elsewhere)
    def run_queue_seconds():
        import threading
        try:
            with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as stat:
                return int(stat.read().split()[1]) / 1e9
        except OSError:
            return 0.0

    # (phase, its parent phase, the object, its method): each one's wall time summed over a batch's steps;
    # a phase whose object is None is not timed in this row (torch-pjrt's, on vLLM's CPU platform)
    def step_breakdown(llm, batch):
        core = llm.llm_engine.engine_core.engine_core
        runner = core.model_executor.driver_worker.worker.model_runner
        programs = client = builder = copied_later = None
        if current_platform.device_type == "pjrt":
            from torch_pjrt.runtime import client, programs
            from torch_pjrt.serving.vllm import attention, worker
            builder, copied_later = attention.PjrtAttentionMetadataBuilder, worker.TokensCopiedLater
        phases = [
            ("engine step", None, core, "step_fn"),
            ("schedule", "engine step", core.scheduler, "schedule"),
            ("execute_model", "engine step", runner, "execute_model"),
            ("update states", "execute_model", runner, "_update_states"),
            ("prepare inputs", "execute_model", runner, "_prepare_inputs"),
            ("attention metadata", "execute_model", runner, "_build_attention_metadata"),
            ("pjrt metadata build", "attention metadata", builder, "build"),
            ("preprocess", "execute_model", runner, "_preprocess"),
            ("model forward", "execute_model", runner, "_model_forward"),
            ("pjrt program calls from Python (the step's graph, the sampled rows' program)", "model forward",
             programs and programs.Program, "call"),
            ("pjrt copies to the host (waiting for the programs)", "model forward", client, "to_host_many"),
            ("logits (and their copy to the host)", "execute_model", runner.model, "compute_logits"),
            ("sample_tokens", "engine step", runner, "sample_tokens"),
            ("sample", "sample_tokens", runner, "_sample"),
            ("bookkeeping (sampled ids to lists)", "sample_tokens", runner, "_bookkeeping_sync"),
            # async scheduling: the previous step's tokens read when the engine takes its output
            ("the step's tokens to the host (TokensCopiedLater.get_output)", "engine step", copied_later,
             "get_output"),
            ("scheduler update", "engine step", core.scheduler, "update_from_output"),
        ]
        spent, calls = defaultdict(float), defaultdict(int)

        def timed(label, method):
            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return method(*args, **kwargs)
                finally:
                    spent[label] += time.perf_counter() - start
                    calls[label] += 1
            return wrapper

        originals = [(owner, name, getattr(owner, name)) for _, _, owner, name in phases if owner is not None]
        for label, _, owner, name in phases:
            if owner is not None:
                setattr(owner, name, timed(label, getattr(owner, name)))
        used, start, host = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), time.thread_time()
        queued = run_queue_seconds()
        batch()
        spent["generate"] = time.perf_counter() - start
        queued = run_queue_seconds() - queued
        host, now = time.thread_time() - host, resource.getrusage(resource.RUSAGE_SELF)
        process = now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime
        for owner, name, method in originals:
            setattr(owner, name, method)
        steps = calls["execute_model"]
        rows = [("generate (the whole batch)", spent["generate"], None)]
        for label, parent, _, _ in phases:
            children = [spent[child] for child, up, _, _ in phases if up == label]
            rows.append((label, spent[label], parent))
            if children:  # every row's table lists the same phases, timed or not
                rows.append((f"{label}: rest", spent[label] - sum(children), label))
        rows.append(("outside engine steps", spent["generate"] - spent["engine step"], None))
        # CPU, not wall: above wall when threads overlap; what the host thread leaves to others is the
        # program's (XLA's thread pool) in pjrt rows, the model's (torch's OpenMP threads) on vLLM's CPU platform
        rows.append(("CPU time, the process's threads", process, None))
        rows.append(("CPU time, the engine's (host) thread", host, "CPU time, the process's threads"))
        rows.append(("CPU time, the other threads", process - host, "CPU time, the process's threads"))
        # runnable but not running: on a host with no idle core, the threads a program launch wakes take it
        rows.append(("the engine's thread waiting for a core (Linux run queue)", queued, None))
        return {"steps": steps, "ms_per_step": [(label, 1000 * value / steps, parent) for label, value, parent in rows]}

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform
    if __name__ == "__main__":
        folder, mode, profile = sys.argv[1], sys.argv[6], sys.argv[7]
        requests, new_tokens, repeats, kv_mib = map(int, sys.argv[2:6])
        llm = LLM(model=folder, skip_tokenizer_init=True, enforce_eager=not mode.startswith("compiled"),
                  dtype="float32", max_model_len=256, max_num_seqs=requests, kv_cache_memory_bytes=kv_mib << 20)
        prompts = [TokensPrompt(prompt_token_ids=[(7 * i + 3 * j) % 250 + 3 for j in range(8 + 9 * (i % 6))])
                   for i in range(requests)]
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
        context = None
        if mode.endswith("fused"):
            import torch
            from torch_pjrt.eager.modes import EagerMode
            context = torch.pjrt.set_eager_mode(EagerMode.DEFER_AND_FUSE)
            context.__enter__()
        first = SamplingParams(temperature=0, max_tokens=1, detokenize=False)
        llm.generate(prompts, params, use_tqdm=False)
        best = first_token = float("inf")
        for repeat in range(repeats):
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
            # time to first token: the same requests with new prompts (no prefix cached), one token each
            fresh = [TokensPrompt(prompt_token_ids=[(t + 11 * (repeat + 1)) % 250 + 3 for t in p["prompt_token_ids"]])
                     for p in prompts]
            start = time.perf_counter()
            llm.generate(fresh, first, use_tqdm=False)
            first_token = min(first_token, time.perf_counter() - start)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        breakdown = None
        if profile == "breakdown":
            breakdown = step_breakdown(llm, lambda: llm.generate(prompts, params, use_tqdm=False))
        if profile == "1" and current_platform.device_type == "pjrt":
            from torch.profiler import ProfilerActivity, profile as profiler
            with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as window:
                llm.generate(prompts, params, use_tqdm=False)
            print(window.key_averages().table(sort_by="self_device_time_total", row_limit=12), file=sys.stderr)
        print("RESULT " + json.dumps({"platform": current_platform.device_type, "seconds": best,
                                      "first_token": first_token, "tokens": tokens, "breakdown": breakdown}))
    """
)


def _tiny_llama(folder: str) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def _run(folder: str, args: argparse.Namespace, platform: str, mode: str) -> dict:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCH_PJRT_VLLM_SAMPLING=args.sampling,
               TORCH_PJRT_VLLM_ASYNC_SCHEDULING=str(int("async" in mode.split("-"))))
    if platform == "cpu":
        env["VLLM_PLUGINS"] = ""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(SERVE)
    counts = [args.requests, args.new_tokens, args.repeats, args.kv_cache_mib]
    profile = "breakdown" if args.breakdown else str(int(args.profile))
    command = [sys.executable, script.name, folder, *map(str, counts), mode, profile]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    os.unlink(script.name)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{platform}/{mode} failed:\n{done.stderr[-3000:]}")
    if args.profile and platform == "pjrt":
        table = done.stderr[done.stderr.index("-" * 20) :]
        print(f"{platform}/{mode}: one more batch under torch.profiler (device time in the Self PJRT column)\n{table}")
    return json.loads(lines[-1][len("RESULT ") :])


def _print_breakdown(rows: list[tuple[str, dict]]) -> None:
    """One column per row: ms per engine step of one more batch, wall in each phase (nested phases indented),
    then CPU by thread."""
    tables = [row["breakdown"]["ms_per_step"] for _, row in rows]
    print("| phase, ms per step (wall; CPU where named) | " + " | ".join(name for name, _ in rows) + " |")
    print("|---" * (len(rows) + 1) + "|")
    print("| steps | " + " | ".join(str(row["breakdown"]["steps"]) for _, row in rows) + " |")
    depth = {label: 0 if parent is None else 1 for label, _, parent in tables[0]}
    for label, _, parent in tables[0]:
        if parent is not None:
            depth[label] = depth[parent] + 1
    for index, (label, _, _) in enumerate(tables[0]):
        values = " | ".join(f"{table[index][1]:.2f}" for table in tables)
        print(f"| {'. ' * depth[label]}{label} | {values} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-mib", type=int, default=16)
    parser.add_argument("--profile", action="store_true", help="print each pjrt row's device time per program")
    parser.add_argument("--breakdown", action="store_true",
                        help="time one more batch's engine steps phase by phase (wall ms per step) in every row")
    parser.add_argument("--sampling", choices=["auto", "device", "host"], default="auto",
                        help="where the pjrt rows run vLLM's sampler (TORCH_PJRT_VLLM_SAMPLING)")
    parser.add_argument("--rows", default="cpu,strict,fused,compiled,compiled-fused,compiled-async",
                        help="the rows to run, comma-separated, of: cpu (vLLM's CPU platform, always run: the "
                             "reference), strict, fused, compiled, compiled-fused, compiled-async")
    args = parser.parse_args()
    names = {
        ("cpu", "strict"): "vLLM CPU platform",
        ("pjrt", "strict"): "pjrt plugin, strict eager",
        ("pjrt", "fused"): "pjrt plugin, DEFER_AND_FUSE",
        ("pjrt", "compiled"): "pjrt plugin, compiled (strict eager around it)",
        ("pjrt", "compiled-fused"): "pjrt plugin, compiled (DEFER_AND_FUSE around it)",
        ("pjrt", "compiled-async"): "pjrt plugin, compiled, vLLM's async scheduling",
    }
    asked = set(args.rows.split(",")) | {"cpu"}
    names = {key: name for key, name in names.items() if (key[0] if key[0] == "cpu" else key[1]) in asked}
    best: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory() as folder:
        _tiny_llama(folder)
        for _ in range(args.rounds):
            for key in names:
                row = _run(folder, args, *key)
                if key in best and row["tokens"] != best[key]["tokens"]:
                    raise RuntimeError(
                        f"{names[key]}: tokens differ between rounds (a serving bug): report it with this command line"
                    )
                if key not in best or row["seconds"] < best[key]["seconds"]:
                    best[key] = row
    rows = [(names[key], best[key]) for key in names]
    if args.breakdown:
        _print_breakdown(rows)
    reference = rows[0][1]["tokens"]
    output_tokens = args.requests * args.new_tokens
    longest = 8 + 9 * min(args.requests - 1, 5)
    print(
        f"{args.requests} requests (prompts 8..{longest} tokens), {args.new_tokens} new tokens each, "
        f"KV cache {args.kv_cache_mib} MiB; pjrt rows sample with TORCH_PJRT_VLLM_SAMPLING={args.sampling}; "
        f"best of {args.rounds} interleaved rounds"
    )
    print("| platform | seconds | output tokens/s | time to first token, s | tokens equal CPU platform's |")
    print("|---|---|---|---|---|")
    for name, row in rows:
        assert row["platform"] == ("cpu" if name.startswith("vLLM") else "pjrt"), row["platform"]
        rate = output_tokens / row["seconds"]
        equal = row["tokens"] == reference
        print(f"| {name} | {row['seconds']:.2f} | {rate:.1f} | {row['first_token']:.3f} | {equal} |")


if __name__ == "__main__":
    main()

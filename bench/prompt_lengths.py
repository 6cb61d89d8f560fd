"""Issue 33's prompt-length goal: 12 new prompt lengths through Hugging Face generate(), pjrt against torch CPU.

The sweep of bench/dynamic_eager.py (a 4-layer Llama, greedy, 8 new tokens, two warm-up prompts, then
12 new lengths 5..60, prompts marked dynamic automatically, each pjrt prompt's one run against CPU's best
of 3 in the same process), in strict and DEFER_AND_FUSE, each in a fresh process on an empty cache
folder and then in another fresh process on the folder the first one filled. Every process starts from
our Python bytecode compiled beforehand, as an installed package does (bench/first_step.py).
Goals: pjrt / CPU <= 5 on the empty folder and <= 1.5 on the filled one. Each row is followed by its
lengths' seconds and new programs, so a length that compiles or loads shows against the others; the filled
row then by its split: the lengths where the empty row made new programs (what the folder serves) against
the others, whose seconds are the same work in both processes (no program is new there in either), with
CPU's seconds for those lengths: their ratio is the steady one, which no cache folder lowers. Strict eager's
steady ratio is bound by its per-op cost: a forward pass of this Llama runs 184 one-op programs (ops_executed
over the sweep's forward passes), each a jax call and a trip through PyTorch's dispatcher.
Run: .venv/bin/python bench/prompt_lengths.py
"""

from __future__ import annotations

import tempfile

from dynamic_eager import BENCH, GENERATE, run
from first_step import BYTECODE_READ, compile_bytecode


def main() -> None:
    compile_bytecode()
    print("generate(): 12 new prompt lengths 5..60 after 2 warm-ups, 8 new tokens, automatic marks")
    print(f"{'mode':<8}{'cache folder':<14}{'programs':>9}{'pjrt s':>8}{'cpu s':>7}{'pjrt / CPU':>11}{'goal':>6}"
          "  tokens equal")
    for mode in ("strict", "fused"):
        code = GENERATE.format(mode=mode, marks="automatic", cache="dynamic", bench=BENCH)
        with tempfile.TemporaryDirectory() as folder:
            rows = {}
            for label, goal in (("empty", 5.0), ("filled", 1.5)):
                row = rows[label] = run(code, TORCH_PJRT_CACHE_DIR=folder, TORCH_PJRT_DYNAMIC_GENERATE="1",
                                        **BYTECODE_READ)
                ratio = row["pjrt_s"] / row["cpu_s"]
                print(f"{mode:<8}{label:<14}{row['compiles']:>9.0f}{row['pjrt_s']:>8.2f}{row['cpu_s']:>7.2f}"
                      f"{ratio:>11.2f}{'met' if ratio <= goal else 'no':>6}  {row['equal']}", flush=True)
                print("        per length, pjrt s (programs): " + " ".join(
                    f"{length}: {seconds:.2f}" + (f" ({count:.0f})" if count else "")
                    for length, (seconds, count, _) in row["lengths"].items()), flush=True)
            print("        " + filled_split(rows["empty"]["lengths"], rows["filled"]["lengths"]), flush=True)
    print("(programs: new programs during the 12 lengths: XLA compiles, and fused programs loaded from the cache "
          "folder; prompt 60 and its 8 new tokens exceed 64, so generate()'s marks "
          "put that whole generation in bucket 128, whose programs are new)")


def filled_split(empty: dict, filled: dict) -> str:
    """The filled row's seconds split into the lengths where the empty row made new programs (the folder's
    part: loading them, and each new program's first run) and the rest, beside the empty row's rest and CPU's
    (the rest's pjrt / CPU is the steady ratio: no cache folder brings the row below it)."""
    new = [length for length, (_, count, _) in empty.items() if count]
    rest = [length for length in filled if length not in new]
    filled_rest, empty_rest = (sum(row[length][0] for length in rest) for row in (filled, empty))
    cpu_rest = sum(filled[length][2] for length in rest)
    loaded = sum(filled[length][0] for length in new)
    above = loaded - filled_rest / max(len(rest), 1) * len(new)
    return (f"filled split: {len(rest)} lengths with no new programs in either process {filled_rest:.2f} s "
            f"(empty row's same lengths {empty_rest:.2f} s; CPU's {cpu_rest:.2f} s, pjrt / CPU "
            f"{filled_rest / cpu_rest:.2f}); length(s) {', '.join(map(str, new))} whose "
            f"programs come from the folder {loaded:.2f} s, {above:.2f} s above a length with none")


if __name__ == "__main__":
    main()

"""Turn bad-input battery rows (JSON lines from battery.run_errors) into docs/bad-input.md.

Usage: python -m battery.errors_report [RESULTS] [--md PATH]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
from typing import Any

from battery.run_errors import DEFAULT_OUT, OUTCOMES, is_defect
from battery.run_opinfo import read_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MD_PATH = os.path.join(ROOT, "docs", "bad-input.md")
# outcome -> the column heading of the per-key table
COLUMNS = {
    "raises-same-class": "same class", "raises-deferred-runtimeerror": "deferred", "returns-cpu-value": "CPU's value",
    "unsupported": "unsupported", "returns-value-where-cpu-raises": "**value where CPU raises**",
    "raises-other-class": "other class", "raises-where-cpu-returns": "raises where CPU returns",
    "returns-other-value": "other value", "crash": "crash", "hang": "hang", "skip": "skip",
}
# Findings left open, by key: what they are and why they are not fixed yet.
OPEN: dict[str, str] = {
    "errors:amax": "PyTorch's meta kernel raises RuntimeError where CPU raises IndexError for a reduction over an "
                   "empty dim; pjrt takes the meta kernel's class (the same for amin, aminmax, median, argmin).",
    "errors:amin": "as errors:amax.",
    "errors:aminmax": "out= dtype checks: the out= wrapper casts instead of refusing an out of another dtype "
                      "(also errors:complex).",
    "errors:as_strided_scatter": "no check that the strided view fits the storage.",
    "errors:bucketize": "no rank check of the boundaries in the lowering (jax raises TypeError).",
    "errors:cat": "a 0-d tensor: PyTorch's decomposition fails with IndexError before CPU's check.",
    "errors:complex": "dtype checks made by a PyTorch decomposition's assert (AssertionError) and missing for out=.",
    "errors:gradient": "a meta-device spacing tensor: the battery's copy to pjrt fails first (a case about devices).",
    "errors:index_add": "the source-shape check CPU makes (PyTorch's meta kernel does not) is not in the lowering yet.",
    "errors:kthvalue": "out= overlap with the input: the out is resized, and kthvalue is not in OVERLAP_REFUSED.",
    "errors:masked_scatter": "a uint8 mask is accepted (CPU refuses it).",
    "errors:narrow_copy": "a dim out of range: IndexError from PyTorch's decomposition, RuntimeError on CPU.",
    "errors:nn.functional.conv1d": "a negative dilation reaches jax (TypeError); CPU checks it (also conv2d/conv3d, "
                                   "and conv3d's negative padding is not refused).",
    "errors:nn.functional.conv2d": "as conv1d.",
    "errors:nn.functional.conv3d": "as conv1d.",
    "errors:nn.functional.embedding": "a weight that is not 2-D: PyTorch's decomposition asserts (AssertionError).",
    "hypothesis:embedding": "embedding_bag's offsets[0] != 0 is not a device check yet (torch_pjrt/ops/nn.py is being "
                            "split into a package; the check belongs there).",
    "hypothesis:nll_loss/cross_entropy": "an int32 target is accepted (CPU wants int64 or uint8); a target or weight "
                                         "of the wrong shape fails an assert in PyTorch's decomposition.",
    "hypothesis:index_put_": "empty destinations: CPU checks no index when nothing is written, the device check "
                             "still does; index_put_ on an expanded tensor is refused (CPU warns and writes); "
                             "broadcast errors come from jax (ValueError).",
    "hypothesis:index_add/copy/fill": "index_add_'s source-shape and index-dtype checks and index_fill_'s int64 check "
                                      "are missing; empty destinations as for index_put_.",
    "hypothesis:index_select": "a 0-d input with dim -2 is not refused; empty inputs fail in jax.",
    "hypothesis:index": "an index on an empty dim fails in jax's gather (TypeError) before the check.",
    "hypothesis:bincount": "a count of 2**40 bins: jax's out-of-memory error escapes untranslated from the bincount "
                           "kernel (eager/data_dependent.py), not torch.OutOfMemoryError.",
    "hypothesis:cat/stack": "dim and rank errors come from PyTorch's decompositions with another class.",
    "hypothesis:huge": "sizes whose strides overflow int64 fail in PyTorch's Python argument parsing (TypeError) "
                       "before pjrt's allocation check.",
    "hypothesis:pointwise_binary": "integer remainder/division by zero (CPU raises ZeroDivisionError as a "
                                   "RuntimeError) is not a device check; shifts of floats fail in jax (TypeError).",
    "hypothesis:pointwise_unary": "dtypes CPU has no kernel for (frac of ints, round of bools) compute a value; "
                                  "bitwise_not/frac of the wrong dtype fail in jax with another class.",
    "hypothesis:reductions": "empty reductions: the meta kernel's class (see errors:amax); median of an empty tensor "
                             "returns a value where CPU returns nan; std/var of ints are not refused.",
    "hypothesis:repeat_interleave": "a 0-d float repeats tensor: the rank check comes before CPU's dtype check. After "
                                    "its cases whose total is 2**40 (OutOfMemoryError, as expected), "
                                    "torch.pjrt.memory_allocated() stays up by the size asked until the key ends (not "
                                    "reproduced with one call alone; not bisected yet), so later cases in the same "
                                    "worker raise OutOfMemoryError: the raises-where-CPU-returns rows of "
                                    "hypothesis:binary_cross_entropy and of this key.",
    "hypothesis:binary_cross_entropy": "every case here raises OutOfMemoryError only because of the accounting left "
                                       "by hypothesis:repeat_interleave in the same worker (see there); the key passes "
                                       "alone (tests/test_bad_inputs.py).",
    "hypothesis:one_hot": "one_hot of an empty tensor with num_classes=0 is not refused (CPU infers no classes).",
    "hypothesis:scatter": "an empty index of another rank fails in jax (IndexError) where CPU writes nothing.",
    "hypothesis:take/put_": "put_ into an empty tensor: the internal-overlap message, not CPU's IndexError.",
    "hypothesis:view/reshape": "a view of an empty tensor with a side of 2**62 hangs (over 60 s) on pjrt.",
}


def by_key(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    keys: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for row in rows:
        if "outcome" in row:
            keys[row["key"]].append(row)
    return dict(sorted(keys.items()))


def totals(keys: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Cases per outcome and per source, and the defects."""
    rows = [row for found in keys.values() for row in found]
    outcomes = collections.Counter(row["outcome"] for row in rows)
    sources = collections.Counter(key.split(":")[0] for key, found in keys.items() for row in found)
    return {"cases": len(rows), "keys": len(keys), "outcomes": dict(outcomes), "sources": dict(sources),
            "defects": sum(is_defect(row) for row in rows),
            "justified": sum(bool(row.get("justified")) for row in rows),
            "keys_with_defects": sum(any(is_defect(row) for row in found) for found in keys.values()),
            "message_as_database": sum(bool(row.get("pjrt_as_database")) for row in rows
                                       if row["outcome"] == "raises-same-class" and "pjrt_as_database" in row),
            "message_checked": sum("pjrt_as_database" in row for row in rows if row["outcome"] == "raises-same-class")}


def _cell(text: Any) -> str:
    return str(text or "").replace("|", "\\|").replace("\n", " ")


def markdown(keys: dict[str, list[dict[str, Any]]], meta: dict[str, Any]) -> str:
    summary = totals(keys)
    examples = meta.get("examples", "?")
    lines = [
        "# Bad inputs: where CPU raises, pjrt raises", "",
        "Generated by `make battery-errors` (`python -m battery.run_errors`, then `python -m battery.errors_report`). "
        "Every ErrorInput of PyTorch's OpInfo database (`op.error_inputs(\"cpu\")`, tensors moved to pjrt with their "
        "views and aliases kept, plus the database's mixed-device cases for a non-CPU device, checked against its "
        "exception class), and property-based cases drawn with hypothesis (battery/properties.py: shapes, dtypes, "
        "out-of-range and huge indices, empty and 0-d tensors, NaN/inf, non-contiguous and overlapping views, "
        f"huge sizes), {examples} derandomized cases per property. Each case runs on CPU, then on pjrt with the "
        "host waiting for every output (so a deferred device-side check is raised), each key in a worker process "
        "(a crash or a hang is recorded, not fatal).", "",
        "Outcomes: *same class* (pjrt raises CPU's exception class), *deferred* (the RuntimeError of a device-side "
        "check raised at the host wait: CUDA's contract, see [device-checks.md](device-checks.md)), *CPU's value* "
        "(neither raises, the values match), *unsupported* (a missing lowering, not a bad-input defect), and the "
        "defects: **value where CPU raises** (the one the battery exists for), *other class*, *raises where CPU "
        "returns* (over-strict), *other value*, *crash*, *hang*.", "",
        f"torch {meta.get('torch', '?')}; {summary['keys']} keys, {summary['cases']} cases "
        f"({', '.join(f'{n} {s}' for s, n in sorted(summary['sources'].items()))}); {meta.get('jobs', '?')} workers, "
        f"{meta.get('seconds', 0) / 60:.1f} minutes, finished {meta.get('finished', '?')}.", "",
        "## Totals", "", "| outcome | cases |", "|---|---|",
    ]
    lines += [f"| {COLUMNS[o]} | {summary['outcomes'].get(o, 0)} |" for o in OUTCOMES]
    lines += [
        f"| **defects** (justified other classes not counted: {summary['justified']}) | {summary['defects']} |",
        f"| keys with a defect | {summary['keys_with_defects']} |", "",
        f"Of the same-class cases with a message in PyTorch's database, {summary['message_as_database']} of "
        f"{summary['message_checked']} also match its message pattern on pjrt.", "",
        "## Per key", "",
        "| key | cases | " + " | ".join(COLUMNS[o] for o in OUTCOMES) + " |", "|---" * (len(OUTCOMES) + 2) + "|",
    ]
    for key, found in keys.items():
        counts = collections.Counter(row["outcome"] for row in found)
        cells = " | ".join(str(counts.get(o, "")) for o in OUTCOMES)
        lines.append(f"| `{key}` | {len(found)} | {cells} |")
    lines += ["", "## Every case that does not match", "",
              "Per key: the outcome, the case, what CPU raised, what pjrt did (and where it raised).", ""]
    for key, found in keys.items():
        odd = [row for row in found if OUTCOMES[row["outcome"]]]
        if not odd:
            continue
        lines += [f"### `{key}`", ""]
        if key in OPEN:
            lines += [f"Left open: {OPEN[key]}", ""]
        for row in odd:
            where = f" (at {row['raised_at']})" if row.get("raised_at") else ""
            why = f" Justified: {row['justified']}." if row.get("justified") else ""
            lines.append(f"- **{row['outcome']}** `{_cell(row['what'])[:300]}`: CPU {_cell(row['cpu']) or 'returns'}; "
                         f"pjrt {_cell(row['pjrt']) or 'returns'}{where}.{why}")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m battery.errors_report", description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", default=DEFAULT_OUT)
    parser.add_argument("--md", default=MD_PATH)
    args = parser.parse_args(argv)
    keys = by_key(read_rows(args.results))
    meta = {}
    if os.path.exists(args.results + ".meta.json"):
        with open(args.results + ".meta.json") as f:
            meta = json.load(f)
    with open(args.md, "w") as f:
        f.write(markdown(keys, meta))
    summary = totals(keys)
    print(f"{summary['cases']} cases in {summary['keys']} keys: {summary['defects']} defects; "
          + ", ".join(f"{o} {n}" for o, n in sorted(summary["outcomes"].items())) + f"; wrote {args.md}")


if __name__ == "__main__":
    main()

"""Turn battery results (JSON lines from battery.run_opinfo) into docs/op-coverage.md and the shipped JSON.

Usage: python -m battery.report [RESULTS...] [--md PATH] [--json PATH] [--save-rows PATH.gz]

docs/opinfo-results.jsonl.gz keeps the rows behind the committed report: pass it first and new
result files after it (later rows win) to update the report without rerunning everything.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import time
from typing import Any

from battery.run_opinfo import DEFAULT_OUT, DTYPES, read_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MD_PATH = os.path.join(ROOT, "docs", "op-coverage.md")
JSON_PATH = os.path.join(ROOT, "torch_pjrt", "data", "op_coverage.json")
ROWS_PATH = os.path.join(ROOT, "docs", "opinfo-results.jsonl.gz")
SYMBOLS = {"pass": "✓", "fail-wrong": "W", "fail-error": "E", "unsupported": "U", "crash": "C", "skip": "S"}
FAILING = ("crash", "fail-wrong", "fail-error", "unsupported")
MISSING = re.compile(r"no lowering for (aten::[\w.]+|prims::[\w.]+)")


def collect(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per entry: its aten name, the aten ops its CPU run called, and its cells {(dtype, direction): row}."""
    entries: dict[str, dict[str, Any]] = {}
    for row in rows:
        entry = entries.setdefault(row["key"], {"aten_name": None, "aten": set(), "cells": {}})
        if row.get("event") == "plan":
            entry["aten_name"] = row.get("aten_name")
        elif row["dtype"] == "*":
            entry["cells"] = {c: row for c in entry["cells"]} or {("float32", "forward"): row}
        else:
            entry["cells"][(row["dtype"], row["direction"])] = row
            entry["aten"].update(row.get("aten", ()))
    return entries


def category(cells: dict[tuple[str, str], dict[str, Any]]) -> str:
    """One word for an entry: pass (every cell), partial (some), or why none passes."""
    statuses = [row["status"] for row in cells.values() if row["status"] != "skip"]
    if not cells:
        return "untested"
    if not statuses:
        return "skip"
    if all(s == "pass" for s in statuses):
        return "pass"
    if "pass" in statuses:
        return "partial"
    return next(s for s in FAILING if s in statuses)


def _compared(entry: dict[str, Any]) -> list[dict[str, Any]]:
    return [row for row in entry["cells"].values() if row["status"] not in ("skip", "crash")]


def samples_run(entry: dict[str, Any], capped_runs: bool) -> str:
    """How many samples an entry's cells compared, all dtypes and directions together: "+" when a run capped at
    the first n samples per cell left some out, "?" when a row predates runs recording that and some run was
    capped (the runs table says which dtypes)."""
    rows = _compared(entry)
    mark = ("+" if any(row.get("capped") for row in rows)
            else "?" if capped_runs and any("capped" not in row for row in rows) else "")
    return f"{sum(row.get('total', 0) for row in rows)}{mark}"


def _rate(entries: dict[str, dict[str, Any]], dtype: str, direction: str) -> tuple[int, int]:
    cells = [e["cells"].get((dtype, direction)) for e in entries.values()]
    counted = [c for c in cells if c is not None and c["status"] != "skip"]
    return sum(c["status"] == "pass" for c in counted), len(counted)


def summary(entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Totals and the issue's target rates."""
    categories = collections.Counter(category(e["cells"]) for e in entries.values())
    having = lambda test: sum(any(test(c) for c in e["cells"].values()) for e in entries.values())
    rates = {}
    for dtype in DTYPES:
        for direction in ("forward", "backward"):
            passed, total = _rate(entries, dtype, direction)
            if total:
                rates[f"{dtype} {direction}"] = {"passed": passed, "total": total,
                                                 "percent": round(100.0 * passed / total, 1)}
    return {
        "entries": len(entries),
        "pass_fully": categories["pass"],
        "pass_partly": categories["partial"],
        "no_cell_passes": sum(categories[s] for s in FAILING),
        "skipped": categories["skip"],
        "untested": categories["untested"],
        "with_unsupported": having(lambda c: c["status"] == "unsupported"),
        "with_wrong_values": having(lambda c: c["status"] == "fail-wrong" and not c.get("near")),
        "with_rounding_only": having(lambda c: c["status"] == "fail-wrong" and c.get("near")),
        "with_errors": having(lambda c: c["status"] == "fail-error"),
        "with_crashes": having(lambda c: c["status"] == "crash"),
        "samples": sum(row.get("total", 0) for e in entries.values() for row in _compared(e)),
        "cells_capped": sum(bool(row.get("capped")) for e in entries.values() for row in _compared(e)),
        "cells_unmarked": sum("capped" not in row for e in entries.values() for row in _compared(e)),
        "rates": rates,
    }


def missing_lowerings(entries: dict[str, dict[str, Any]]) -> list[tuple[str, int]]:
    """Ops named by 'no lowering' errors, by how many entries they block."""
    blocked: dict[str, set[str]] = collections.defaultdict(set)
    for key, entry in entries.items():
        for row in entry["cells"].values():
            for name in MISSING.findall(row.get("detail", "")):
                blocked[name].add(key)
    return sorted(((name, len(keys)) for name, keys in blocked.items()), key=lambda item: (-item[1], item[0]))


NAMESPACES = ("nn.functional", "linalg", "fft", "special", "masked", "sparse", "signal.windows", "_refs")


def family(key: str) -> str:
    """The namespace of an entry (torch.* entries are `torch`)."""
    return next((n for n in NAMESPACES if key.startswith(n + ".")), "torch")


def failure_kinds(entries: dict[str, dict[str, Any]]) -> list[tuple[str, int]]:
    """First-line messages of failing cells with numbers and quoted names blurred, by entries affected."""
    kinds: dict[str, set[str]] = collections.defaultdict(set)
    for key, entry in entries.items():
        for row in entry["cells"].values():
            if row["status"] in FAILING:
                text = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", row.get("detail", ""))
                if text.startswith("Mismatched elements"):
                    text = "values within 1e-3 (rounding)" if row.get("near") else "values beyond 1e-3"
                text = MISSING.sub("no lowering for X", re.sub(r"'[^']*'", "'X'", text))
                kinds[f"{row['status']}: {text[:90]}"].add(key)
    return sorted(((kind, len(keys)) for kind, keys in kinds.items()), key=lambda item: (-item[1], item[0]))


def failing_families(entries: dict[str, dict[str, Any]]) -> list[tuple[str, int, int]]:
    """(family, entries not passing fully, entries) for families with failures, worst first."""
    counts: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for key, entry in entries.items():
        counts[family(key)][1] += 1
        counts[family(key)][0] += category(entry["cells"]) not in ("pass", "skip")
    return sorted(((f, bad, n) for f, (bad, n) in counts.items() if bad), key=lambda item: (-item[1], item[0]))


# --- writing ---------------------------------------------------------------------------------


def _cell_text(entry: dict[str, Any], dtype: str) -> str:
    parts = []
    for direction in ("forward", "backward"):
        row = entry["cells"].get((dtype, direction))
        if row is None:
            continue
        text = SYMBOLS[row["status"]]
        if row["status"] == "fail-wrong" and row.get("near"):
            text = "w"
        if row["status"] not in ("pass", "skip", "crash") and row.get("total"):
            text += f" {row['passed']}/{row['total']}"
        parts.append(text)
    return " / ".join(parts)


def markdown(entries: dict[str, dict[str, Any]], totals: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = ["# Op coverage: PyTorch's OpInfo database on pjrt", ""]
    lines += _header(totals, meta)
    lines += _targets(totals)
    lines += ["", "## Most wanted lowerings", "",
              "Ops named by a missing-lowering error, with the number of entries each one blocks.", "",
              "| op | entries |", "|---|---|"]
    lines += [f"| `{name}` | {count} |" for name, count in missing_lowerings(entries)[:30]]
    lines += ["", "## Families with failures", "", "| family | entries not passing fully | entries |", "|---|---|---|"]
    lines += [f"| {f} | {bad} | {n} |" for f, bad, n in failing_families(entries)]
    lines += ["", "## Kinds of failure", "", "| status: first line (numbers and names blurred) | entries |",
              "|---|---|"]
    lines += [f"| {kind.replace('|', '/')} | {count} |" for kind, count in failure_kinds(entries)[:25]]
    lines += ["", "## Per entry and dtype", "",
              "Each cell is `forward / backward` (backward only in float32 and float64, for differentiable "
              "entries). ✓ pass, W wrong values, w wrong only by rounding (within test_compare_cpu's 1e-3), "
              "E error, U unsupported (NotImplementedError), C crash or hang, S skipped (battery/skips.py); "
              "`n/m` samples passed; empty: the entry does not support the dtype on CPU. *samples*: samples "
              "compared in all its cells together; `+`: a run capped at the first n samples per cell left some "
              "out; `?`: some of its rows come from runs before the battery recorded that, and some runs were "
              "capped (the runs table says which dtypes).", ""]
    capped_runs = any(run.get("max_samples") for run in meta.get("runs", []))
    lines += ["| entry | " + " | ".join(DTYPES) + " | samples |", "|---" * (len(DTYPES) + 2) + "|"]
    for key in sorted(entries):
        cells = " | ".join(_cell_text(entries[key], d) for d in DTYPES)
        lines.append(f"| `{key}` | {cells} | {samples_run(entries[key], capped_runs)} |")
    lines += ["", "## What fails, and how", "", "The first failing sample's message per cell that does not pass.", ""]
    for key in sorted(entries):
        for (dtype, direction), row in sorted(entries[key]["cells"].items()):
            if row["status"] in FAILING:
                detail = row.get("detail", "").replace("|", "\\|").replace("\n", " ")
                lines.append(f"- `{key}` {dtype} {direction}: **{row['status']}** {detail}")
    return "\n".join(lines) + "\n"


def _header(totals: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    runs = meta.get("runs", [])
    lines = [
        "Generated by `make battery-ops` (`python -m battery.run_opinfo`, then `python -m battery.report`): every "
        "entry of `torch.testing._internal.common_methods_invocations.op_db`, every sample input (or its first n "
        "per cell in a capped run: see the runs table and each entry's *samples*), run on pjrt and "
        "on CPU and compared with `torch.testing.assert_close` at its per-dtype defaults (float16 atol 1e-3 "
        "rtol 2e-3, bfloat16 atol 1e-2 rtol 1.6e-2), after the sample's `output_process_fn_grad` as in "
        "`test_compare_cpu` (a floating result that misses CPU's passes when its error against the same inputs "
        "in double precision is at most twice CPU's; other results must match); gradients of a fixed-weight sum "
        "of the outputs in float32 and float64; random entries compared by shape, dtype and device only. A "
        "*cell* is one (entry, dtype, direction); an entry passes a cell when every sample passes.",
        "",
    ]
    if runs:
        lines += ["| run | entries | dtypes | samples per cell | workers | minutes | finished |",
                  "|---|---|---|---|---|---|---|"]
        for number, run in enumerate(runs, 1):
            cap = f"first {run['max_samples']}" if run.get("max_samples") else "all"
            lines.append(f"| {number} | {run['entries']} | {', '.join(run['dtypes'])} | {cap} | {run['jobs']} | "
                         f"{run['seconds'] / 60:.1f} | {run['finished']} |")
        lines += ["", f"torch {meta.get('torch', '?')}. Later runs replace earlier rows for the entries and dtypes "
                  "they ran. A run capped at the first n samples per cell samples the battery.", ""]
    lines += [
        "## Totals", "",
        "| entries | count |", "|---|---|",
        f"| OpInfo entries run | {totals['entries']} |",
        f"| passing fully (every cell) | {totals['pass_fully']} |",
        f"| passing partly | {totals['pass_partly']} |",
        f"| passing in no cell | {totals['no_cell_passes']} |",
        f"| skipped entirely | {totals['skipped']} |",
        f"| without a dtype the runs covered | {totals['untested']} |",
        f"| with an unsupported cell | {totals['with_unsupported']} |",
        f"| with wrong results | {totals['with_wrong_values']} |",
        f"| with wrong results only by rounding (within 1e-3) | {totals['with_rounding_only']} |",
        f"| with an error | {totals['with_errors']} |",
        f"| with a crash or hang | {totals['with_crashes']} |",
        "", "| samples | count |", "|---|---|",
        f"| samples compared (every cell, forward and backward) | {totals['samples']} |",
        f"| cells a capped run cut short | {totals['cells_capped']} |",
        f"| cells from runs before that was recorded | {totals['cells_unmarked']} |",
    ]
    return lines


def _targets(totals: dict[str, Any]) -> list[str]:
    lines = ["", "## Pass rates (issue targets: float32 forward 95%, float32 backward 90%, other dtypes 90%)", "",
             "Entries whose every sample passes, over entries tested in that cell (skips not counted).", "",
             "| dtype, direction | passing | tested | rate |", "|---|---|---|---|"]
    for name, rate in totals["rates"].items():
        lines.append(f"| {name} | {rate['passed']} | {rate['total']} | {rate['percent']}% |")
    return lines


def shipped(entries: dict[str, dict[str, Any]], totals: dict[str, Any]) -> dict[str, Any]:
    """The JSON `torch-pjrt ops` reads: per entry and dtype, forward/backward status; aten op -> entries."""
    aten: dict[str, list[str]] = collections.defaultdict(list)
    out: dict[str, Any] = {}
    for key in sorted(entries):
        entry = entries[key]
        dtypes: dict[str, dict[str, str]] = {}
        details: dict[str, str] = {}
        order = list(DTYPES) + ["*"]
        for (dtype, direction), row in sorted(entry["cells"].items(), key=lambda item: order.index(item[0][0])):
            dtypes.setdefault(dtype, {})[direction] = row["status"]
            if row["status"] in FAILING and row.get("detail"):
                details[f"{dtype} {direction}"] = row["detail"][:160]
        out[key] = {"aten_name": entry["aten_name"], "status": category(entry["cells"]), "dtypes": dtypes}
        if details:
            out[key]["details"] = details
        for name in sorted(entry["aten"]):
            aten[name].append(key)
    return {"generated": time.strftime("%Y-%m-%d", time.gmtime()), "summary": totals, "entries": out,
            "aten": dict(sorted(aten.items()))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m battery.report", description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="*", default=[DEFAULT_OUT], help="result files; later rows win")
    parser.add_argument("--md", default=MD_PATH)
    parser.add_argument("--json", default=JSON_PATH)
    parser.add_argument("--save-rows", metavar="PATH.gz",
                        help="also keep every row read (and the runs) in one gzip file, a base for later reports")
    args = parser.parse_args(argv)
    rows = [row for path in args.results for row in read_rows(path)]
    entries = collect(rows)
    meta: dict[str, Any] = {"runs": []}
    for path in args.results:
        if os.path.exists(path + ".meta.json"):
            with open(path + ".meta.json") as f:
                found = json.load(f)
            meta = {"torch": found.get("torch"), "runs": meta["runs"] + found.get("runs", [])}
    if args.save_rows:
        with gzip.open(args.save_rows, "wt") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        with open(args.save_rows + ".meta.json", "w") as f:
            json.dump(meta, f, indent=1)
    totals = summary(entries)
    with open(args.md, "w") as f:
        f.write(markdown(entries, totals, meta))
    with open(args.json, "w") as f:
        json.dump(shipped(entries, totals), f, indent=None, separators=(",", ":"))
        f.write("\n")
    rates = ", ".join(f"{k} {v['percent']}%" for k, v in totals["rates"].items())
    print(f"{totals['entries']} entries: {totals['pass_fully']} fully, {totals['pass_partly']} partly; {rates}")
    print(f"wrote {args.md} and {args.json}")


if __name__ == "__main__":
    main()

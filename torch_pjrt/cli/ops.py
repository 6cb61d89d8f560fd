"""`torch-pjrt ops [NAME...]`: is an op supported on pjrt, in which dtypes, forward and backward?

Answers from the OpInfo battery's results shipped in torch_pjrt/data/op_coverage.json
(written by `make battery-ops`). NAME may be an OpInfo entry (`nn.functional.conv2d`,
`max.reduction_with_dim`), an aten op (`aten::addmm`, `addmm.default`, `linalg_svd`) or a substring.
"""

from __future__ import annotations

import argparse
import json
from importlib import resources
from typing import Any

MAX_SHOWN = 20
STATUS_WORDS = {"pass": "pass", "partial": "partly", "fail-wrong": "WRONG VALUES", "fail-error": "error",
                "unsupported": "unsupported", "crash": "CRASH", "skip": "skipped"}


def load() -> dict[str, Any]:
    """The shipped coverage table."""
    return json.loads(resources.files("torch_pjrt.data").joinpath("op_coverage.json").read_text())


def _aten_base(name: str) -> str:
    """`aten::addmm.default` -> `addmm`."""
    return name.split("::", 1)[-1].split(".", 1)[0]


def resolve(name: str, data: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(entries that are NAME, entries that merely exercise aten op NAME)."""
    entries = data["entries"]
    if name in entries:
        return [name], []
    prefixed = [k for k in entries if k.startswith(name + ".")]
    if prefixed:
        return prefixed, []
    base = _aten_base(name)
    named = [k for k, e in entries.items() if e.get("aten_name") == base]
    if named:
        return named, []
    if "::" in name or base in {_aten_base(a) for a in data.get("aten", {})}:
        users = sorted({k for a, keys in data.get("aten", {}).items() if _aten_base(a) == base for k in keys})
        return [], users
    return sorted(k for k in entries if name in k), []


def describe(key: str, entry: dict[str, Any]) -> list[str]:
    """An entry's status and its dtype table."""
    aten = f" (aten::{entry['aten_name']})" if entry.get("aten_name") else ""
    lines = [f"{key}{aten}: {STATUS_WORDS.get(entry['status'], entry['status'])}",
             f"  {'dtype':<10} {'forward':<13} backward"]
    for dtype, directions in entry["dtypes"].items():
        lines.append(f"  {dtype:<10} {directions.get('forward', '-'):<13} {directions.get('backward', '-')}")
    for cell, detail in entry.get("details", {}).items():
        lines.append(f"  {cell}: {detail}")
    return lines


def summary(data: dict[str, Any]) -> list[str]:
    totals = data["summary"]
    lines = [f"OpInfo battery ({data.get('generated', '?')}): {totals['entries']} entries; "
             f"{totals['pass_fully']} pass fully, {totals['pass_partly']} partly, "
             f"{totals['no_cell_passes']} in no dtype; {totals['with_wrong_values']} with wrong values, "
             f"{totals['with_crashes']} with crashes."]
    for name, rate in totals["rates"].items():
        lines.append(f"  {name:<18} {rate['passed']:>4}/{rate['total']:<4} {rate['percent']:5.1f}%")
    lines.append("Ask about ops with `torch-pjrt ops NAME...` (OpInfo names, aten names or substrings).")
    return lines


def report(names: list[str], data: dict[str, Any]) -> tuple[list[str], bool]:
    """Text answering each name, and whether every name was found."""
    lines: list[str] = []
    found_all = True
    for name in names:
        keys, users = resolve(name, data)
        if keys:
            for key in keys[:MAX_SHOWN]:
                lines += describe(key, data["entries"][key])
            if len(keys) > MAX_SHOWN:
                lines.append(f"... and {len(keys) - MAX_SHOWN} more entries matching {name!r}")
        elif users:
            passing = [k for k in users if data["entries"][k]["status"] == "pass"]
            lines.append(f"{name}: no OpInfo entry of its own; called by {len(users)} entries, "
                         f"{len(passing)} of which pass fully: {', '.join(users[:MAX_SHOWN])}"
                         + (" ..." if len(users) > MAX_SHOWN else ""))
        else:
            found_all = False
            lines.append(f"{name}: not in the OpInfo battery's results")
    return lines, found_all


def command(args: argparse.Namespace) -> int:
    data = load()
    if args.format == "json":
        picked = {k: data["entries"][k] for name in args.names for k in sum(resolve(name, data), [])}
        print(json.dumps(picked if args.names else data["summary"], indent=2))
        return 0
    if not args.names:
        print("\n".join(summary(data)))
        return 0
    lines, found_all = report(args.names, data)
    print("\n".join(lines))
    return 0 if found_all else 1


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("ops", help="op coverage from the OpInfo battery: dtypes, forward, backward")
    parser.add_argument("names", nargs="*", metavar="NAME", help="OpInfo entry, aten op or substring")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.set_defaults(func=command)

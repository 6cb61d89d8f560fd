"""`torch-pjrt`: one command per migration step (inventory, run, measure)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS = ("info", "cache", "scan", "run", "bench", "ops", "zoo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torch-pjrt",
        description="Move CUDA PyTorch code to the pjrt device: inventory it, run it unmodified, measure it.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"torch_pjrt.cli.{name}")
        except ImportError as error:
            if error.name != f"torch_pjrt.cli.{name}":
                raise
            continue
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

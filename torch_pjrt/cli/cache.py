"""`torch-pjrt cache`: the persistent compile cache folder, shown, pruned and cleared.

The folder holds XLA's executables (`xla/`, jax's persistent cache), our traced torch.compile
graphs (`graphs/`), the executables of those graphs, fused programs and strict ops (`executables/`),
strict ops' device-side checks (`op_checks/`), padded ops' forms (`forms/`), per script the
executables its last process used (`preload/`), AOTAutograd's entries for compiled graphs
(`aotautograd/<digest of torch_pjrt's code>/`) and Dynamo's stored frames of compiled functions
(`dynamo/<digest of torch_pjrt's code>/`); ranks of one job and later processes share it
(TORCH_PJRT_CACHE_DIR). The per-version folders of other code versions can never hit again: prune
removes them first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

KINDS = {"xla": "XLA executables", "graphs": "traced torch.compile graphs",
         "executables": "compiled graphs', fused programs' and strict ops' executables, loaded without tracing",
         "op_checks": "strict ops' device-side checks, read with their executables",
         "forms": "padded (dynamic) ops' forms: how their results' sizes follow the dynamic lengths",
         "preload": "per script: the executables its last process used, which the next one preloads",
         "aotautograd": "AOTAutograd's entries for compiled graphs, per version of torch_pjrt",
         "dynamo": "Dynamo's traced frames of compiled functions and their guards, per version of torch_pjrt",
         "torch_source_key": "PyTorch's digest of its source files (AOTAutograd's keys hold it), per torch install",
         "registration": "the overloads and schema facts the device's start registers, per torch_pjrt and torch"}
# kinds kept in a folder per version of torch_pjrt's code, their entries nested below it
VERSIONED = ("aotautograd", "dynamo")


def _entries(folder: Path, kind: str) -> list[Path]:
    """The entry files of one kind (not jax's access-time stamps, locks or unfinished writes); AOTAutograd's
    and Dynamo's entries are nested in folders of their own."""
    root = folder / kind
    if not root.is_dir():
        return []
    files = root.rglob("*") if kind in VERSIONED else root.iterdir()
    return [path for path in files if path.is_file() and not path.name.startswith(".")
            and not path.name.endswith("-atime")]


def _stale_versions(folder: Path) -> list[Path]:
    """AOTAutograd's and Dynamo's folders written by another version of torch_pjrt's code."""
    from torch_pjrt.compile import warm_start

    current = warm_start.code_folder_name()
    return [path for kind in VERSIONED if (folder / kind).is_dir() for path in (folder / kind).iterdir()
            if path.is_dir() and path.name != current]


def _last_used(path: Path) -> float:
    stamp = path.with_name(path.name.removesuffix("-cache") + "-atime")
    return max(path.stat().st_mtime, stamp.stat().st_mtime if stamp.exists() else 0.0)


def summary(folder: Path) -> dict[str, Any]:
    """Entries and bytes per kind."""
    kinds = {}
    for kind, meaning in KINDS.items():
        files = _entries(folder, kind)
        kinds[kind] = {"meaning": meaning, "entries": len(files), "bytes": sum(p.stat().st_size for p in files)}
    return {"folder": str(folder), "kinds": kinds}


def _remove(path: Path) -> int:
    size = path.stat().st_size
    path.unlink(missing_ok=True)
    path.with_name(path.name.removesuffix("-cache") + "-atime").unlink(missing_ok=True)
    return size


def prune(folder: Path, max_bytes: int | None, older_than_days: float | None) -> tuple[int, int]:
    """Remove AOTAutograd's and Dynamo's folders of other code versions, then the least recently used entries until the
    folder holds at most `max_bytes`, and those unused for `older_than_days`; returns (entries removed, bytes
    freed)."""
    removed = freed = 0
    for stale in _stale_versions(folder):
        files = [path for path in stale.rglob("*") if path.is_file()]
        removed, freed = removed + len(files), freed + sum(path.stat().st_size for path in files)
        shutil.rmtree(stale, ignore_errors=True)
    entries = sorted((path for kind in KINDS for path in _entries(folder, kind)), key=_last_used)
    if older_than_days is not None:
        cutoff = time.time() - older_than_days * 86400
        for path in [p for p in entries if _last_used(p) < cutoff]:
            freed += _remove(path)
            removed += 1
        entries = [p for p in entries if p.exists()]
    if max_bytes is not None:
        total = sum(p.stat().st_size for p in entries)
        for path in entries:
            if total <= max_bytes:
                break
            size = _remove(path)
            total -= size
            freed += size
            removed += 1
    return removed, freed


def command(args: argparse.Namespace) -> int:
    from torch_pjrt.cli.run import format_bytes
    from torch_pjrt.runtime import client

    folder = client.cache_dir()
    if folder is None:
        print("the persistent cache is disabled (TORCH_PJRT_CACHE_DIR=0)")
        return 1
    path = Path(folder)
    if args.action == "clear":
        for kind in KINDS:
            shutil.rmtree(path / kind, ignore_errors=True)
        print(f"cleared {folder}")
        return 0
    if args.action == "prune":
        if args.max_bytes is None and args.older_than_days is None:
            print("torch-pjrt cache prune needs --max-bytes N or --older-than-days D")
            return 2
        removed, freed = prune(path, args.max_bytes, args.older_than_days)
        print(f"removed {removed} entries ({format_bytes(freed)}) from {folder}")
        return 0
    found = summary(path)
    if args.format == "json":
        print(json.dumps(found, indent=2))
        return 0
    print(f"cache folder  {folder}{'' if os.path.isdir(folder) else ' (not created yet)'}")
    for kind, row in found["kinds"].items():
        print(f"  {kind + '/':<8} {row['entries']:>6} entries  {format_bytes(row['bytes']):>10}  {row['meaning']}")
    return 0


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("cache", help="show, prune or clear the persistent compile cache")
    parser.add_argument("action", nargs="?", choices=("show", "prune", "clear"), default="show")
    parser.add_argument("--max-bytes", type=int, help="prune: keep at most this many bytes, least recently used go")
    parser.add_argument("--older-than-days", type=float, help="prune: remove entries unused for this many days")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.set_defaults(func=command)

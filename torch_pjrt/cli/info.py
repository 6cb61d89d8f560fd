"""`torch-pjrt info`: what this install would run on, and with which settings."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from typing import Any

PACKAGES = ("torch", "jax", "jaxlib", "torch-pjrt")
ENVIRONMENT_PREFIXES = ("TORCH_PJRT_", "JAX_", "XLA_", "PJRT_")


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def folder_size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                continue
    return total


def devices() -> dict[str, Any]:
    """The platform and each device's name and memory; an `error` entry when the runtime cannot start."""
    import torch

    try:
        count = torch.pjrt.device_count()
        properties = [torch.pjrt.get_device_properties(index) for index in range(count)]
    except Exception as error:  # noqa: BLE001 (reported, not raised: info must describe a broken setup too)
        return {"platform": None, "devices": [], "error": f"{type(error).__name__}: {error}"}
    return {
        "platform": properties[0].platform if properties else None,
        "devices": [{"index": p.index, "name": p.name, "total_memory": p.total_memory,
                     "memory_source": p.memory_source} for p in properties],
    }


def collect() -> dict[str, Any]:
    import torch_pjrt
    from torch_pjrt.eager import modes
    from torch_pjrt.runtime import client

    cache = client.cache_dir()
    versions = {package: version(package) for package in PACKAGES}
    versions["torch-pjrt"] = versions["torch-pjrt"] or torch_pjrt.__version__
    found = devices()
    from torch_pjrt import distributed

    return {
        **found,
        "distributed": distributed.engine(),
        "versions": versions,
        "python": sys.version.split()[0],
        "eager_mode": modes.current().value,
        "cache_dir": cache,
        "cache_bytes": folder_size(cache) if cache and os.path.isdir(cache) else 0,
        "environment": {key: value for key, value in sorted(os.environ.items())
                        if key.startswith(ENVIRONMENT_PREFIXES)},
    }


def format_text(info: dict[str, Any]) -> str:
    from torch_pjrt.cli.run import format_bytes

    lines = [f"platform      {info['platform'] or 'unavailable'}"]
    if "error" in info:
        lines.append(f"  error       {info['error']}")
    for device in info["devices"]:
        lines.append(f"pjrt:{device['index']:<8} {device['name']}, {format_bytes(device['total_memory'])} "
                     f"({device['memory_source']})")
    lines.append(f"collectives   {_engine_text(info['distributed'])}")
    lines += [f"{name:<13} {value or 'not installed'}" for name, value in info["versions"].items()]
    lines += [f"python        {info['python']}",
              f"eager mode    {info['eager_mode']}",
              f"cache dir     {info['cache_dir'] or 'disabled (TORCH_PJRT_CACHE_DIR=0)'}"
              + (f" ({format_bytes(info['cache_bytes'])})" if info["cache_dir"] else "")]
    environment = info["environment"]
    lines.append("environment" + ("" if environment else "   no TORCH_PJRT_*, JAX_*, XLA_* or PJRT_* variables set"))
    lines += [f"  {key}={value}" for key, value in environment.items()]
    return "\n".join(lines)


def _engine_text(engine: dict[str, Any]) -> str:
    """Which engine c10d's backend "pjrt" uses here, and why."""
    if engine["engine"] == "xla" and engine["processes"] == 1:
        return "XLA programs (a job of one process)"
    if engine["engine"] == "xla":
        return (f"XLA programs on jax's multi-process runtime (process {engine['process']} of {engine['processes']}, "
                f"coordinator {engine['coordinator']})")
    return f"gloo over host copies ({engine['reason']}; torchrun starts jax's runtime)"


def command(args: argparse.Namespace) -> int:
    info = collect()
    print(json.dumps(info, indent=2) if args.format == "json" else format_text(info))
    return 1 if "error" in info else 0


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("info", help="platform, devices, versions, eager mode, cache, environment")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.set_defaults(func=command)

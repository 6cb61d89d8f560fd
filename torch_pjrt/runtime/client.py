"""The PJRT client: platform choice, devices, host<->device transfers, device memory.

jax is configured here, once, before its first backend use: 64-bit types on (PyTorch
has real float64/int64), the CPU device count, and the persistent compile cache.
Faults are handled here too: allocations the device cannot hold become torch.OutOfMemoryError,
a forked child of a process that started jax refuses device work (it would hang), and a cache
folder that cannot be written turns caching off with one warning.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import re
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from torch_pjrt.runtime import checks, memory, metrics, multiprocess

PLATFORM_ALIASES = {"cpu": "cpu", "cuda": "cuda", "gpu": "cuda", "tpu": "tpu", "rocm": "rocm"}


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torch_pjrt")


_cache_lock = threading.Lock()
_cache_failures: list[OSError] = []


def cache_dir() -> str | None:
    """The persistent compile cache folder, or None when TORCH_PJRT_CACHE_DIR=0 disables it
    or writing to it has failed."""
    value = os.environ.get("TORCH_PJRT_CACHE_DIR")
    if value == "0" or _cache_failures:
        return None
    return value or _default_cache_dir()


def cache_failed(error: OSError) -> None:
    """The cache folder cannot be written (read-only, full, not a folder): warn once, cache nothing more.

    Compiling still works, only the saving is lost; jax itself would warn once per program.
    """
    with _cache_lock:
        if _cache_failures:
            return
        folder = cache_dir()
        _cache_failures.append(error)
    warnings.warn(
        f"torch_pjrt: the compile cache folder {folder} cannot be written ({error}); compiling without a "
        "persistent cache from now on: set TORCH_PJRT_CACHE_DIR to a writable folder with free space, or to 0.",
        RuntimeWarning,
        stacklevel=2,
    )


_xla_cache_off = threading.local()  # its depth: how many xla_cache_off are open


@contextlib.contextmanager
def xla_cache_off() -> Iterator[None]:
    """Compile this thread's programs meanwhile without XLA's persistent cache, for executables our store
    keeps: one that cache gave serializes without its code on jaxlib's CPU client (running it then fails
    with "Function ... not found"), so they must be compiled, and a copy written there is never read."""
    _xla_cache_off.depth = getattr(_xla_cache_off, "depth", 0) + 1
    try:
        yield
    finally:
        _xla_cache_off.depth -= 1


_one_op_compiles = threading.local()  # its depth: how many one_op_compiles are open on this thread

# XLA options for programs of one op (strict eager) whose StableHLO is small, where XLA's fixed cost
# dominates: its MLIR fusion emitters cost more compile time than such a program's run returns. Compile
# CPU time over the 182 one-op programs of a Llama generate and a GPT AdamW step (bench/compile_cost.py and
# a per-program split): 0.66x for the 171 up to 10,000 characters, while the 11 larger ones, mostly
# AdamW's multi-tensor foreach updates (18-52 thousand), took 1.7x together: they keep XLA's defaults.
ONE_OP_XLA_OPTIONS = {"cpu": {"xla_cpu_use_fusion_emitters": False}}
ONE_OP_MAX_CHARACTERS = 10_000
# Element types (as StableHLO spells them) whose programs keep XLA's defaults: with the fusion emitters off,
# XLA's CPU backend (jaxlib 0.10.2) converts a negative value that rounds to zero into 0x80, NaN in the float8
# "fnuz" formats, where its fusion emitters and torch give 0 (tests/test_float8.py's casts).
ONE_OP_DEFAULT_TYPES = ("FNUZ",)


def one_op_options() -> dict[str, Any]:
    """The XLA options a small one-op program is compiled with on this platform (part of its stored key)."""
    return ONE_OP_XLA_OPTIONS.get(platform(), {})


@contextlib.contextmanager
def one_op_compiles() -> Iterator[None]:
    """Compile this thread's programs meanwhile as one-op programs: with `one_op_options` added to jax's (as
    jax.jit's compiler_options would be) where their StableHLO has at most ONE_OP_MAX_CHARACTERS; XLA's
    persistent cache keys them, as they are part of what it digests."""
    _one_op_compiles.depth = getattr(_one_op_compiles, "depth", 0) + 1
    try:
        yield
    finally:
        _one_op_compiles.depth -= 1


def _pass_compile_options() -> None:
    """Make jax's compile step add `one_op_options` within `one_op_compiles` (through jax's private module,
    pinned with jaxlib): jax.jit's own compiler_options reach only programs jitted by the caller with them.
    Within `xla_cache_off` it compiles as jax does with its cache disabled (no cache key, read or write);
    with a jax whose compile functions take other arguments, `_GuardedCache` refuses the reads only."""
    from jax._src import compiler

    compile_or_get_cached = compiler.compile_or_get_cached
    signature = inspect.signature(compile_or_get_cached)
    direct = ({"executable_devices", "host_callbacks"} <= signature.parameters.keys()
              and list(inspect.signature(compiler.backend_compile_and_load).parameters)
              == ["backend", "module", "executable_devices", "options", "host_callbacks"])

    def with_options(backend: Any, computation: Any, devices: Any, options: Any, *rest: Any, **named: Any) -> Any:
        wanted = one_op_options() if getattr(_one_op_compiles, "depth", 0) else None
        text = str(computation) if wanted else ""
        if wanted and len(text) <= ONE_OP_MAX_CHARACTERS and not any(t in text for t in ONE_OP_DEFAULT_TYPES):
            options.env_option_overrides = [*options.env_option_overrides, *wanted.items()]
        if direct and getattr(_xla_cache_off, "depth", 0):
            passed = signature.bind(backend, computation, devices, options, *rest, **named).arguments
            return compiler.backend_compile_and_load(backend, computation, passed["executable_devices"], options,
                                                     passed["host_callbacks"])
        return compile_or_get_cached(backend, computation, devices, options, *rest, **named)

    compiler.compile_or_get_cached = with_options


class _GuardedCache:
    """jax's persistent cache with its I/O errors sent to `cache_failed`, not to jax (which warns once per
    program); after a failure it reads and writes nothing. Entries are written whole: jax writes its file in
    place, so a rank reading an entry another rank was writing (torchrun ranks share the folder) could load
    a torn one; here each entry is written to a private file and renamed into place."""

    def __init__(self, base: Any) -> None:
        self.base = base

    def get(self, key: str) -> bytes | None:
        if _cache_failures or getattr(_xla_cache_off, "depth", 0):
            return None
        try:
            return self.base.get(key)
        except OSError as error:
            cache_failed(error)
            return None

    def put(self, key: str, value: bytes) -> None:
        if _cache_failures:
            return
        try:
            if getattr(self.base, "eviction_enabled", True) or "://" in str(getattr(self.base, "path", "")):
                self.base.put(key, value)  # jax's size-bounded cache writes under its file lock; remote stores
                return
            final = os.path.join(self.base.path, f"{key}{_JAX_ENTRY_SUFFIX}")
            if os.path.exists(final):
                return
            with tempfile.NamedTemporaryFile(dir=self.base.path, prefix=".partial-", delete=False) as partial:
                partial.write(value)
            os.replace(partial.name, final)
        except OSError as error:
            cache_failed(error)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)


# The file name jax's cache gives an entry (jax._src.lru_cache, pinned with jaxlib).
_JAX_ENTRY_SUFFIX = "-cache"


def _guard_jax_cache() -> None:
    """Make jax build its persistent cache as a `_GuardedCache` (through jax's private module, pinned
    with jaxlib): a folder it cannot create or write then costs one warning, not one per program."""
    from jax._src import compilation_cache

    make = compilation_cache.get_file_cache

    def guarded(path: str) -> tuple[_GuardedCache, str] | None:
        try:
            cache, where = make(path)
        except OSError as error:
            cache_failed(error)
            return None
        return _GuardedCache(cache), where

    compilation_cache.get_file_cache = guarded


FORKED_MESSAGE = (
    "pjrt cannot run in a process forked from one that had started it (jax's runtime threads do not survive "
    "fork, so it would hang): start DataLoader workers and subprocesses with multiprocessing_context='spawn', "
    "or keep the work of forked workers on CPU tensors."
)
# True in a child forked after jax started (what torch.pjrt._is_in_bad_fork reports).
forked = False


def _in_forked_child() -> None:
    global forked
    forked = True
    jax_module.cache_clear()


def refuse_in_forked_child() -> None:
    """Raise at once where a forked child would otherwise hang in jax."""
    if forked:
        raise RuntimeError(FORKED_MESSAGE)


@functools.cache
def jax_module() -> Any:
    """Import and configure jax on first device use (keeps `import torch` fast)."""
    refuse_in_forked_child()
    import jax

    os.register_at_fork(after_in_child=_in_forked_child)
    jax.config.update("jax_enable_x64", True)
    cpu_devices = os.environ.get("TORCH_PJRT_CPU_DEVICES")
    if cpu_devices:
        jax.config.update("jax_num_cpu_devices", int(cpu_devices))
    multiprocess.initialize(jax)
    folder = cache_dir()
    if folder:
        _guard_jax_cache()
        jax.config.update("jax_compilation_cache_dir", os.path.join(folder, "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        jax.monitoring.register_event_listener(_count_cache_event)
    jax.monitoring.register_event_duration_secs_listener(_count_compile_event)
    _pass_compile_options()
    return jax


_CACHE_EVENTS = {
    "/jax/compilation_cache/cache_hits": "persistent_cache_hits",
    "/jax/compilation_cache/cache_misses": "persistent_cache_misses",
}


# Every program jax builds, whoever asked (our programs, a retrace for new input shapes, a jnp call
# outside a program): lowered to StableHLO once each, then compiled or loaded from the disk cache.
_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILE_PHASES = (
    "/jax/core/compile/jaxpr_trace_duration",
    _LOWERING_EVENT,
    "/jax/core/compile/backend_compile_duration",
)


def _count_compile_event(event: str, seconds: float, **_: object) -> None:
    if event == _LOWERING_EVENT:
        metrics.bump("compiles")
    if event in _COMPILE_PHASES:
        metrics.bump("compile_seconds", seconds)


def _count_cache_event(event: str, **_: object) -> None:
    name = _CACHE_EVENTS.get(event)
    if name is not None:
        metrics.bump(name)


@functools.cache
def platform() -> str:
    """The PJRT platform in use: TORCH_PJRT_PLATFORM, else the best one jaxlib finds."""
    jax = jax_module()
    wanted = os.environ.get("TORCH_PJRT_PLATFORM", "").strip().lower()
    if wanted:
        if wanted not in PLATFORM_ALIASES:
            raise RuntimeError(
                f"TORCH_PJRT_PLATFORM={wanted!r} is not a platform; use one of cpu, cuda, tpu."
            )
        name = PLATFORM_ALIASES[wanted]
        try:
            jax.devices(name)
        except RuntimeError as error:
            raise RuntimeError(
                f"TORCH_PJRT_PLATFORM={wanted} but jaxlib finds no {name} devices ({error}); "
                "install the jaxlib plugin for it or unset the variable."
            ) from None
        return name
    return jax.default_backend()


@functools.cache
def devices() -> tuple[Any, ...]:
    """This process's devices (jax.devices() lists every process's once its distributed runtime runs)."""
    return tuple(jax_module().local_devices(backend=platform()))


def device_for(index: int | None) -> Any:
    all_devices = devices()
    index = 0 if index is None else index
    if not 0 <= index < len(all_devices):
        raise RuntimeError(
            f"pjrt:{index} does not exist: this process has {len(all_devices)} pjrt device(s) "
            f"on {platform()} (set TORCH_PJRT_CPU_DEVICES=N for more CPU devices)."
        )
    return all_devices[index]


@functools.cache
def array_type() -> type:
    """The concrete type of jax's device arrays, for exact type checks: isinstance against jax.Array costs
    about 1.3 us (its metaclass's check), paid per argument on the hot paths that ask."""
    return type(jax_module().device_put(np.zeros((0,), np.float32), device_for(0)))


def to_device(value: np.ndarray, index: int) -> Any:
    """A device array of a host array that the caller gives up (jax may read it later, or keep it on CPU)."""
    metrics.bump("transfers_to_device")
    metrics.bump("bytes_to_device", value.nbytes)
    try:  # (inline, not out_of_memory_translated: a generator's context per put, a batch's transfer each step)
        return _put_on(index)(value)
    except (RuntimeError, MemoryError) as error:
        if not is_out_of_memory(error):
            raise
        raise out_of_memory_from(error, (), index) from None


@functools.cache
def _put_on(index: int) -> Callable[[np.ndarray], Any]:
    """The put that jax.device_put(value, device, may_alias=True) ends in (jaxlib's batched put of one
    committed, possibly aliased buffer), called directly: jax's Python dispatch around it was ~30 of its
    ~38 us a batch. A jax whose private put differs (checked once on a small array) gets the public call."""
    jax = jax_module()
    device = device_for(index)

    def public(value: np.ndarray) -> Any:
        return jax.device_put(value, device, may_alias=True)

    try:
        from jax._src import core
        from jax._src.lib import xla_client

        sharding = jax.sharding.SingleDeviceSharding(device)
        batched_put, abstract = xla_client.batched_device_put, core.shaped_abstractify
        # each (shape, dtype)'s abstract value made once, not by jax's Python per put (a training step's batch, met
        # cold after the step's host wait); jax x64 is on for the process (jax_module), as these were made under
        avals: dict[tuple[tuple[int, ...], np.dtype], Any] = {}

        def direct(value: np.ndarray) -> Any:
            key = (value.shape, value.dtype)
            aval = avals.get(key)
            if aval is None:
                if len(avals) >= 4096:  # (bounded: a server meets a new shape per prompt length)
                    avals.clear()
                aval = avals[key] = abstract(value)
            return batched_put(aval, sharding, [value], [device], True)

        probe = np.arange(3, dtype=np.int32)
        if np.array_equal(np.asarray(direct(probe)), probe):
            return direct
    except (ImportError, AttributeError, TypeError):
        pass
    return public


@functools.cache
def argument_avals(executable: Any) -> tuple[list[Any], Any]:
    """A compiled executable's arguments as jax's abstract values (shape, dtype, weak type), flat, and their
    tree: jax's ArgInfo shows the weak type only on its private abstract value."""
    infos, structure = jax_module().tree_util.tree_flatten(executable.args_info)
    return [info._aval for info in infos], structure


def weak_scalar_maker() -> Callable[[Any, Any], Any] | None:
    """`make(value, dtype)`, inside a traced program: `value` (a traced scalar) as `dtype` and weakly typed, the
    type jax gives a Python number, so it promotes as one (a float32 tensor times it stays float32); through
    jax's private conversion, since jax has no public way to make a weakly typed value. None where this jax's
    private function is missing or makes no weak type (checked once by tracing it): callers then pass numbers
    one by one."""
    jax = jax_module()
    try:
        from jax._src.lax import lax as lax_internal

        convert = lax_internal._convert_element_type

        def make(value: Any, dtype: Any) -> Any:
            return convert(value, dtype, weak_type=True)

        probe = jax.eval_shape(lambda pack: make(pack[0], pack.dtype), np.zeros(1, np.float64))
        if getattr(probe, "weak_type", False) and probe.shape == ():
            return make
    except (ImportError, AttributeError, TypeError):
        pass
    return None


# Traced Python numbers by value: a program called with a number converts it on every call (about
# 2 us, more than a small op's device work); with an uncommitted array of the same weakly typed kind
# it does not, and runs the same compiled program (a committed one would compile another).
# A value is made an array the second time it is seen: one seen once (a decaying learning rate)
# costs a conversion per call, never an array per call. None marks a value seen once.
_scalars: dict[tuple, Any] = {}
_SCALARS_KEPT = 1024
_UNSEEN = object()


def _number_key(value: Any, index: int) -> tuple | None:
    kind = type(value)
    if kind is float:
        return (index, kind, value, math.copysign(1.0, value))  # 0.0 == -0.0, and they differ
    if kind is complex:
        return (index, kind, value, math.copysign(1.0, value.real), math.copysign(1.0, value.imag))
    if kind is int or kind is bool:
        return (index, kind, value)
    return None


def _remember(key: tuple, array: Any) -> None:
    if len(_scalars) >= _SCALARS_KEPT:
        _scalars.clear()
    _scalars[key] = array


def _made_array(key: tuple, value: Any, index: int) -> Any:
    """The array of `value`, made now and kept under `key`; an int beyond int64 as it is."""
    jax = jax_module()
    try:
        with jax.default_device(device_for(index)):
            array = jax.device_put(value)
    except OverflowError:
        return value
    _remember(key, array)
    return array


def scalar_array(value: Any, index: int) -> Any:
    """The weakly typed device array of a traced Python number on pjrt:`index`, made once per value;
    an int beyond int64 as it is."""
    key = _number_key(value, index)
    array = _scalars.get(key)
    return _made_array(key, value, index) if array is None else array


def traced_number(value: Any, index: int) -> Any:
    """What a program is called with for a traced value: a number seen before as its device array,
    a new one as it is (remembered), anything else (a host array) as it is."""
    key = _number_key(value, index)
    if key is None:
        return value
    array = _scalars.get(key, _UNSEEN)
    if array is _UNSEEN:
        _remember(key, None)
        return value
    return _made_array(key, value, index) if array is None else array


def to_host(array: Any) -> np.ndarray:
    return to_host_many([array])[0]


def to_host_many(arrays: list[Any]) -> list[np.ndarray]:
    """Several arrays to the host in one transfer request (one wait, not one per array).

    It waits first: jaxlib aborts the process when it converts an array whose program failed
    (an allocation XLA could not make), where waiting raises that failure.
    """
    jax = jax_module()
    with out_of_memory_translated(arrays):
        jax.block_until_ready(list(arrays))
        # Pending device-side check codes already computed come back in the same request (raised below).
        # Codes of programs still running stay pending: waiting for them would stop the host from going on
        # while later programs run (a read of token n's answer while token n+1's program runs).
        taken = checks.take(ready_only=True)
        fetched = [*arrays, *(item.code for item in taken)]
        if taken:  # a failed program's code raises in the wait, where reading it would abort
            jax.block_until_ready(fetched[len(arrays):])
        # jax.device_get's own pytree walk costs ~10 us a call (a loss.item() each step): start every copy,
        # then read each, as it does. On CPU the read is a view of the buffer either way, and the started
        # copy only waits on another thread (6-300 us a read on this loaded 2-core machine, ~1 us without).
        if platform() != "cpu":
            for value in fetched:
                value.copy_to_host_async()
        values = [np.asarray(value) for value in fetched]
    checks.verify(taken, values[len(values) - len(taken):])
    del values[len(values) - len(taken):]
    metrics.bump("transfers_to_host", len(values))
    metrics.bump("bytes_to_host", sum(v.nbytes for v in values))
    return values


def synchronize(arrays: Any = None) -> None:
    """Wait for queued work: for the given arrays, or for every live array."""
    jax = jax_module()
    targets = list(arrays) if arrays is not None else jax.live_arrays()
    with out_of_memory_translated(targets):
        for array in targets:
            array.block_until_ready()


# --- device memory ---------------------------------------------------------------------------

# A request under this share of the device is left to its allocator, without a memory query.
_UNCHECKED_SHARE = 16


@functools.cache
def memory_limit(index: int) -> tuple[int, str]:
    """What pjrt:index can hold, and where that figure comes from (PJRT's CPU client reports none)."""
    stats = device_for(index).memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), "PJRT bytes_limit"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host, "host memory: PJRT reports no limit for this device"


def free_memory(index: int) -> int:
    """Bytes pjrt:index can still allocate: PJRT's limit less its bytes in use; on host memory, the host's
    available memory, and never more than its size less what pjrt storages hold (torch.empty ones included,
    which take no memory until written)."""
    stats = device_for(index).memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    left = memory_limit(index)[0] - memory.stats.allocated(index)
    return min(left, _host_available(left))


def _host_available(otherwise: int) -> int:
    """The kernel's MemAvailable (free plus reclaimable memory), or `otherwise` without /proc (not Linux)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return otherwise


def unchecked_bytes(index: int) -> int:
    """The allocations of pjrt:index below this many bytes skip check_fits's free-memory query (a small share of
    the device, which the native torch.empty repeats without calling here)."""
    return -(-memory_limit(index)[0] // _UNCHECKED_SHARE)


def check_fits(index: int, nbytes: int) -> None:
    """Raise torch.OutOfMemoryError before allocating more than pjrt:index has free.

    Where the device is host memory (the CPU platform), an allocation the host cannot hold may
    still be granted (memory overcommit), and then exhausts the machine as it is written.
    """
    if nbytes < unchecked_bytes(index):
        return
    total, source = memory_limit(index)
    free = free_memory(index)
    if nbytes > free:
        raise memory.out_of_memory(index, nbytes, total, source, free)


def is_out_of_memory(error: BaseException) -> bool:
    """An allocation failure: XLA's RESOURCE_EXHAUSTED (or a failure it caused), or the host's MemoryError."""
    from jax.errors import JaxRuntimeError

    if isinstance(error, MemoryError):
        return True
    # A program given the result of a failed one fails with INTERNAL, naming the original failure.
    text = str(error)
    return isinstance(error, JaxRuntimeError) and ("RESOURCE_EXHAUSTED" in text or "Out of memory" in text)


def out_of_memory_from(error: BaseException, values: Sequence[Any], index: int | None = None) -> torch.OutOfMemoryError:
    """An allocation failure as torch.OutOfMemoryError, on the given device or else that of the first array."""
    if index is None:
        index = index_of(values)
    text = str(error).strip()
    asked = re.search(r"(\d+) bytes", text)
    total, source = memory_limit(index)
    detail = text.splitlines()[0] if text else type(error).__name__
    return memory.out_of_memory(index, int(asked.group(1)) if asked else None, total, source, detail=detail)


@contextlib.contextmanager
def out_of_memory_translated(values: Sequence[Any], index: int | None = None) -> Iterator[None]:
    """Turn an allocation failure inside into torch.OutOfMemoryError; other errors pass unchanged."""
    try:
        yield
    except (RuntimeError, MemoryError) as error:
        if not is_out_of_memory(error):
            raise
        raise out_of_memory_from(error, values, index) from None


def index_of(values: Sequence[Any]) -> int:
    """The pjrt index of the first device array among `values` (0 when there is none)."""
    array = jax_module().Array
    for value in values:
        if isinstance(value, array):
            placed = value.devices()
            for index, device in enumerate(devices()):
                if device in placed:
                    return index
    return 0

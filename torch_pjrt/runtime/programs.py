"""Jitted programs and their cache, shared by strict eager, fused and compiled execution."""

from __future__ import annotations

import atexit
import hashlib
import os
import pickle
import sys
import threading
import time
import warnings
from collections.abc import Callable, Hashable
from typing import Any

from torch_pjrt.runtime import client, disk_store, metrics, profiling


class Program:
    """One jitted function. Compiles are counted by the client's jax event listener (so retraces for
    new input shapes count too); a program with a `counter` also counts its first call there.

    Its jax.jit (~55 us to make) is made at the first call or read of `jitted`: a strict op whose
    executable comes from the cache folder (or is compiled for it) is replaced before either."""

    __slots__ = ("_run", "_jitted", "_unjitted", "name", "counter", "device_index")

    def __init__(self, fn: Callable, name: str, donate: tuple[int, ...] = (), device_index: int | None = None,
                 counter: str | None = None) -> None:
        self._jitted = None
        self._unjitted = (fn, donate)
        self.name = name
        # A metrics counter of its own kind (e.g. "graph_compiles"), counted besides "compiles".
        self.counter = counter
        self.device_index = device_index
        self._run = self._first_call

    @classmethod
    def of_executable(cls, executable: Any, name: str, counter: str | None = None,
                      device_index: int | None = None) -> Program:
        """A program already compiled (or loaded): its calls compile nothing."""
        program = cls.__new__(cls)
        program._jitted = program._run = executable
        program._unjitted = None
        program.name, program.counter, program.device_index = name, counter, device_index
        return program

    def call(self, *args: Any) -> Any:
        """Run the program. Every program runs here, so faults are handled here, not per op: an allocation
        the device cannot make raises torch.OutOfMemoryError (and the process goes on), a forked child
        refuses at once instead of hanging, and while a profiler records the device each launch is timed."""
        client.refuse_in_forked_child()
        try:
            if profiling.recording is None:
                return self._run(*args)
            return profiling.timed_call(self._run, args, self.name, self.device_index)
        except (RuntimeError, MemoryError) as error:
            self.reraise(error, args)

    def reraise(self, error: BaseException, args: tuple) -> None:
        """Raise a failed call's error: a device allocation failure as torch.OutOfMemoryError, the rest as is."""
        if isinstance(error, (RuntimeError, MemoryError)) and client.is_out_of_memory(error):
            raise client.out_of_memory_from(error, args, self.device_index) from None
        raise error

    @property
    def compiled(self) -> bool:
        """Whether the first call (which compiles and counts) is done, so `jitted` can be called directly."""
        return self._run is self._jitted

    @property
    def jitted(self) -> Any:
        if self._jitted is None:
            fn, donate = self._unjitted
            self._jitted, self._unjitted = _jit(fn, donate, self.device_index), None
        return self._jitted

    def _first_call(self, *args: Any) -> Any:
        start = time.perf_counter()
        jitted = self.jitted
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            result = jitted(*args)
        seconds = time.perf_counter() - start
        if self.counter:
            metrics.bump(self.counter)
            metrics.bump(f"{self.counter}_seconds", seconds)
        self._run = jitted
        return result

    def lower_text(self, *args: Any) -> str:
        return self.jitted.lower(*args).as_text()


def _jit(fn: Callable, donate: tuple[int, ...], device_index: int | None) -> Any:
    """jax.jit of a program: its donated inputs, and its results placed on pjrt:device_index when given."""
    jax = client.jax_module()
    options: dict[str, Any] = {"donate_argnums": donate}
    if device_index is not None:
        options["out_shardings"] = jax.sharding.SingleDeviceSharding(client.device_for(device_index))
    return jax.jit(fn, **options)


def stored_executable(fn: Callable, example: tuple, key: str, name: str, counter: str | None = None,
                      donate: tuple[int, ...] = (), device_index: int | None = None) -> Program:
    """The program of `fn` for the example's shapes, as an executable an earlier process stored under
    `key` (a digest of everything `fn` traces to), or compiled now and stored for later processes.

    A loaded executable skips jax's tracing and lowering and XLA's cache lookup: a warm process
    deserializes it and runs. The key adds what an executable depends on besides the traced program:
    jax, the device kind, the devices of the inputs and results, donated inputs and XLA's flags."""
    jax = client.jax_module()
    used = {device.id for leaf in jax.tree_util.tree_leaves(example) if isinstance(leaf, jax.Array)
            for device in leaf.devices()}
    if device_index is not None:
        used.add(client.device_for(device_index).id)
    devices = sorted(used)
    backend = client.devices()[0].client
    digest = hashlib.sha256()
    for part in (key, jax.__version__, backend.platform_version, client.devices()[0].device_kind, devices,
                 os.environ.get("XLA_FLAGS", ""), donate):
        digest.update(str(part).encode())
    stored = digest.hexdigest()
    if len(_used) < PRELOAD_LIMIT:
        _used.setdefault(stored, devices)
    executable = _preloads.claim(stored)
    if executable is None:
        executable = _loaded(stored, devices)
    if executable is not None:
        return Program.of_executable(executable, name, counter, device_index)
    start = time.perf_counter()
    with warnings.catch_warnings(), client.xla_cache_off():  # our store keeps it, not XLA's cache
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        executable = _jit(fn, donate, device_index).lower(*example).compile()
    if counter:
        metrics.bump(counter)
        metrics.bump(f"{counter}_seconds", time.perf_counter() - start)
    made = Program.of_executable(executable, name, counter, device_index)
    from jax.experimental import serialize_executable

    try:
        serialized = serialize_executable.serialize(executable)
    except (ValueError, NotImplementedError):
        return made  # an executable XLA cannot serialize
    disk_store.write("executables", stored, pickle.dumps(serialized))
    return made


def _loaded(stored: str, devices: list[int]) -> Any:
    """The executable stored under this key for these device ids, or None when it is not stored."""
    payload = disk_store.read("executables", stored)
    if payload is None:
        return None
    from jax.experimental import serialize_executable

    serialized, in_tree, out_tree = pickle.loads(payload)
    by_id = {device.id: device for device in client.devices()}
    return serialize_executable.deserialize_and_load(serialized, in_tree, out_tree, backend=client.devices()[0].client,
                                                     execution_devices=[by_id[i] for i in devices] or None)


# The first PRELOAD_LIMIT stored executables this process asked for (key -> device ids), in order: the next
# process of the same entry point preloads them (what its first steps need; a long test session or server
# meets many more, which would only hold memory and a core before they are asked for). 256 covers a strict
# generate() over 2 warm-up and 12 new prompt lengths (bench/prompt_lengths.py: 151 stored executables).
_used: dict[str, list[int]] = {}
PRELOAD_LIMIT = 256


class _Preloads:
    """Stored executables loaded by a background thread, in the order the last process of this entry point
    used them, while the main thread traces and runs (jax's deserialize_and_load releases the GIL for most of
    its time). The thread runs while the device starts, where the main thread waits for Dynamo's import, then
    holds from the start's end to the first claim: in between the main thread builds the model and Dynamo
    traces, Python that a second thread's turns on the GIL only slow (a warm compiled first step, 15
    preloaded, was 0.05-0.35 s slower with the thread running from device start on than with none).
    The main thread claims an entry: it takes the executable when loaded, waits while it loads, and loads it
    itself when the thread has not reached it yet."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, list[int]] = {}  # not begun
        self._loading: dict[str, threading.Event] = {}
        self._done: dict[str, Any] = {}
        self._recorded: list[list[Any]] = []
        self._thread: threading.Thread | None = None
        self._running = threading.Event()  # cleared: the thread holds before its next executable

    def start(self) -> None:
        """Read this entry point's record and start loading it; record this process's at exit."""
        if not disk_store.enabled():
            return
        with disk_store.counted_as("preload_record"):
            payload = disk_store.read("preload", _entry_point())
        self._recorded = [] if payload is None else pickle.loads(payload)
        atexit.register(self._save_record)
        self._waiting = {stored: devices for stored, devices in self._recorded}
        if self._waiting:
            self._running.set()
            self._thread = threading.Thread(target=self._load_all, name="torch_pjrt-preload", daemon=True)
            self._thread.start()

    def hold(self) -> None:
        """Stop the thread before its next executable until the next claim."""
        self._running.clear()

    def _load_all(self) -> None:
        while True:
            self._running.wait()
            with self._lock:
                if not self._waiting:
                    return
                stored, devices = next(iter(self._waiting.items()))
                del self._waiting[stored]
                loaded = self._loading[stored] = threading.Event()
            try:
                with disk_store.counted_as("preload"):
                    executable = self._done[stored] = _loaded(stored, devices)
                _run_once(executable, devices)
            except Exception:  # noqa: BLE001 - a failed preload only loses the head start; the claim loads it again
                self._done.setdefault(stored, None)
            finally:
                loaded.set()

    def claim(self, stored: str) -> Any:
        """The preloaded executable of this key (counted as a hit of the store), or None when not preloaded."""
        self._running.set()
        with self._lock:
            if self._waiting.pop(stored, None) is not None:
                return None
            loading = self._loading.pop(stored, None)
        if loading is None or not (loading.is_set() or self._thread.is_alive()):  # a forked child has no thread
            return None
        loading.wait()
        executable = self._done.pop(stored)
        if executable is not None:
            disk_store.count_hit()
        return executable

    def _save_record(self) -> None:
        with self._lock:
            self._waiting.clear()  # the thread stops after the executable it is loading
        used = [[stored, devices] for stored, devices in _used.items()]
        if used and used != self._recorded:
            with disk_store.counted_as("preload_record"):
                disk_store.write("preload", _entry_point(), pickle.dumps(used))


# The most input bytes a preloaded executable is run once with (zeros); a larger one keeps its first run for its caller.
FIRST_RUN_MAX_BYTES = 64 << 20


def _run_once(executable: Any, devices: list[int]) -> None:
    """Run a preloaded executable once on zeros and drop the results: a loaded executable does part of its loading
    at its first run (XLA's CPU backend, jaxlib 0.10.2: 40-300 ms for a fused decode program that then runs in
    2-20 ms), which would otherwise fall in the step that first needs it. Only where that is safe to do early: a
    program of at most one device (no collective to meet other devices or processes) and small inputs (a second
    copy of a model's weights is not made)."""
    if executable is None or len(devices) > 1:
        return
    jax = client.jax_module()
    avals, structure = client.argument_avals(executable)
    if sum(aval.size * aval.dtype.itemsize for aval in avals) > FIRST_RUN_MAX_BYTES:
        return
    import numpy as np

    device = {device.id: device for device in client.devices()}[devices[0]] if devices else client.devices()[0]
    # (a weakly typed scalar, a traced Python number, as jax makes one: from a Python number)
    zeros = [jax.device_put(np.zeros(aval.shape, aval.dtype).item() if aval.weak_type and not aval.shape
                            else np.zeros(aval.shape, aval.dtype), device) for aval in avals]
    args, kwargs = jax.tree_util.tree_unflatten(structure, zeros)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        jax.block_until_ready(executable(*args, **kwargs))
    metrics.bump("preload_first_runs")


def _entry_point() -> str:
    """The record's key: the script (or module, or -c code) this process runs, in this working folder."""
    script = sys.argv[0] if sys.argv and sys.argv[0] else "-"
    if script == "-c" and "-c" in sys.orig_argv[:-1]:
        script = sys.orig_argv[sys.orig_argv.index("-c") + 1]
    elif os.path.exists(script):
        script = os.path.abspath(script)
    return hashlib.sha256(f"{os.getcwd()}\0{script}".encode()).hexdigest()


_preloads = _Preloads()


def start_preload() -> None:
    """Read which stored executables the last process of this entry point used: a background thread loads
    them until `hold_preload`, and again from the next one this process asks for on."""
    _preloads.start()


def hold_preload() -> None:
    """Pause the preload at the end of the device's start: until the first stored executable is asked for, the
    main thread builds the model and traces, which a second thread's turns on the GIL only slow."""
    _preloads.hold()


class ProgramCache:
    """Programs by structural key; hits and misses are counted."""

    def __init__(self) -> None:
        self.entries: dict[Hashable, Any] = {}

    def get(self, key: Hashable) -> Any:
        entry = self.entries.get(key)
        metrics.bump("cache_hits" if entry is not None else "cache_misses")
        return entry

    def put(self, key: Hashable, entry: Any) -> Any:
        self.entries[key] = entry
        return entry

"""The OpInfo battery: every entry of PyTorch's op database run on pjrt and compared with CPU.

Usage: python -m battery.run_opinfo [--ops NAME...] [--dtypes DTYPE...] [--jobs 2] [--out PATH]

Each entry runs in a worker subprocess (a pool of `--jobs` workers pulling entries from one
queue) so that a segfault or a hang costs one entry, not the run: a worker silent for
IDLE_TIMEOUT seconds, or dead, has its entry recorded as "crash" and is replaced.
Workers print one JSON line per (entry, dtype, direction); the parent writes them to --out
(JSON lines; rows of entries run again replace the old ones) and, for a full run, calls
battery.report to write docs/op-coverage.md and torch_pjrt/data/op_coverage.json.

Per sample the entry's function runs on CPU and on pjrt copies of the same inputs, both outputs
pass through the sample's output_process_fn_grad (as PyTorch's test_compare_cpu does: it makes
sign-ambiguous decompositions comparable) and are compared with torch.testing.assert_close at
its per-dtype defaults, relaxed for float16/bfloat16 only (RELAXED); a floating result (half, float32, complex64)
that misses CPU's still passes when its error against the result of the same inputs in double precision is at most
EXACT_SLACK times CPU's (CPU rounds some intermediates to half precision where pjrt, like CUDA, keeps float32, and
its float32 kernels round in their own order); other results must match. Gradients: a fixed-weight sum of
every differentiable output (see _loss), torch.autograd.grad w.r.t. every input that requires grad,
float32 and float64. Random entries are checked for shape, dtype and device only.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import queue
import random
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from battery.skips import skip_reason

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
    "complex64": torch.complex64,
    # few entries declare float8 (eye, _scaled_mm, _scaled_mm_v2 on torch 2.13); e8m0fnu none
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz,
    "float8_e5m2fnuz": torch.float8_e5m2fnuz,
}
GRAD_DTYPES = ("float32", "float64")
# assert_close's defaults are 1e-5 atol for both half types: too tight near zero for a backend that may
# round intermediates differently (XLA fuses and keeps float32 between fused half-precision ops).
RELAXED: dict[torch.dtype, dict[str, float]] = {
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2},
    torch.float16: {"rtol": 2e-3, "atol": 1e-3},
}
# test_compare_cpu's cross-device tolerance, recorded (not used to pass) to tell rounding from wrong values.
LOOSE = {"rtol": 1e-3, "atol": 1e-3}
# Entries whose values are random or undefined: only shape, dtype and device are compared.
RANDOM_ENTRIES = frozenset({
    "bernoulli", "cauchy", "empty", "empty_like", "empty_permuted", "empty_strided", "exponential", "geometric",
    "log_normal", "multinomial", "new_empty", "new_empty_strided", "nn.functional.alpha_dropout",
    "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.feature_alpha_dropout.with_train", "nn.functional.fractional_max_pool2d",
    "nn.functional.fractional_max_pool3d", "nn.functional.rrelu", "normal", "normal.in_place", "normal.number_mean",
    "pca_lowrank", "rand_like", "randint", "randint_like", "randn", "randn_like", "svd_lowrank", "uniform",
})
# Entries whose extra outputs (saved statistics) follow PyTorch's meta kernels, i.e. CUDA's convention
# (float32 statistics for half inputs, per-channel statistics in eval mode), where CPU's kernels return
# others (pytorch/pytorch#85960; test_compare_cpu expects these entries to fail): the first output is compared.
FIRST_OUTPUT_ONLY = frozenset({"native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update",
                               "native_layer_norm"})
# The dtype a floating sample tensor or result is widened to for the exact reference (see _as_exact_as_cpu).
WIDER = {torch.float16: torch.float64, torch.bfloat16: torch.float64, torch.float32: torch.float64,
         torch.complex64: torch.complex128}
# How much larger than CPU's pjrt's largest error against the exact result may be: two float32 evaluations in
# different orders are equally right, and neither is always the nearer (addbmm's OpInfo samples: pjrt's error is
# below CPU's in 94% of those that miss CPU's, and at most 1.7 times CPU's in the others). A real fault (a lost
# term, float32 computed in half or TF32 precision) misses by orders of magnitude.
EXACT_SLACK = 2.0
STATUS_ORDER = ("crash", "fail-wrong", "fail-error", "unsupported", "pass", "skip")
IDLE_TIMEOUT = 60.0
START_TIMEOUT = 240.0
RESTART_EVERY = 60
DEFAULT_OUT = "build/opinfo/results.jsonl"


def entry_key(op: Any) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def load_entries() -> dict[str, Any]:
    """OpInfo entries by key (importing op_db needs expecttest and hypothesis)."""
    from torch.testing._internal.common_methods_invocations import op_db

    return {entry_key(op): op for op in op_db}


def is_random(key: str, op: Any) -> bool:
    """Listed above, or OpInfo itself calls it through wrapper_set_seed (its mark of a random function)."""
    return key in RANDOM_ENTRIES or "wrapper_set_seed" in getattr(getattr(op.op, "__code__", None), "co_names", ())


def cells(op: Any, dtypes: Iterable[str]) -> list[tuple[str, str]]:
    """The (dtype, direction) pairs an entry is tested in."""
    supported = op.supported_dtypes("cpu")
    backward = op.supported_backward_dtypes("cpu") if op.supports_autograd else set()
    found = []
    for name in dtypes:
        if DTYPES[name] in supported:
            found.append((name, "forward"))
            if name in GRAD_DTYPES and DTYPES[name] in backward:
                found.append((name, "backward"))
    return found


# --- comparing one sample --------------------------------------------------------------------


class Wrong(AssertionError):
    """pjrt returned a value that differs from CPU's; `near` when within test_compare_cpu's 1e-3 (rounding)."""

    def __init__(self, message: str, near: bool = False) -> None:
        super().__init__(message)
        self.near = near


# Arguments PyTorch requires on the CPU whatever the device (CUDA raises the same error for them).
CPU_ARGUMENTS = {"tensor_split": 0}
# Entries that address their input's storage, not its view: as_strided.partial_views reads elements outside
# the view (base[5:15] with storage_offset 0 or 10), which a plain copy (test_compare_cpu's) does not carry.
STORAGE_ENTRIES = frozenset({"as_strided", "as_strided_copy"})


def _copy(value: torch.Tensor, name: str, device: str, dtype: torch.dtype | None = None,
          storages: dict[Any, torch.Tensor] | None = None) -> torch.Tensor:
    """A sample tensor on `device` (in `dtype`); for STORAGE_ENTRIES its whole storage, viewed as the sample is.
    With `storages` (one memo for all of a sample's tensors) every tensor so, one copy per storage: views and
    aliases among the sample's tensors (an out= that is an input, an expanded out=) stay views and aliases."""
    if name not in STORAGE_ENTRIES and storages is None:
        return value.detach().to(device, dtype)
    memo = {} if storages is None else storages
    storage = value.untyped_storage()
    key = (storage.data_ptr(), value.dtype) if storage.nbytes() else id(value)
    if key not in memo:
        whole = value.detach().as_strided((storage.nbytes() // value.element_size(),), (1,), 0)
        memo[key] = whole.to(device, dtype)
    return memo[key].as_strided(value.size(), value.stride(), value.storage_offset())


def _to_pjrt(value: Any, name: str, storages: dict[Any, torch.Tensor] | None = None) -> Any:
    """A pjrt copy of a sample tensor; factories' CPU device becomes pjrt (transform also hands over dtypes).
    A meta tensor stays: it holds no data, and a sample with one is a case about mixing devices."""
    if isinstance(value, torch.device) and value.type == "cpu":
        return torch.device("pjrt")
    if not isinstance(value, torch.Tensor) or value.is_meta:
        return value
    return _copy(value, name, "pjrt", storages=storages).requires_grad_(value.requires_grad)


def on_pjrt(sample: Any, name: str = "", keep_aliases: bool = False) -> Any:
    """The sample with pjrt copies of its tensors; a "cpu" argument (the sample's device, as in `x.to("cpu")`
    or `torch.zeros(..., device="cpu")`) names pjrt instead. `keep_aliases`: tensors sharing a storage on CPU
    share one on pjrt, viewed the same way (see _copy)."""
    storages: dict[Any, torch.Tensor] | None = {} if keep_aliases else None
    moved = sample.transform(lambda value: _to_pjrt(value, name, storages))
    if name in CPU_ARGUMENTS and sample.args:
        position = CPU_ARGUMENTS[name]
        moved.args = (*moved.args[:position], sample.args[position], *moved.args[position + 1:])
    device = lambda v: torch.device("pjrt") if isinstance(v, str) and v == "cpu" else v
    moved.args = tuple(device(v) for v in moved.args)
    moved.kwargs = {k: device(v) for k, v in moved.kwargs.items()}
    return moved


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def compare(actual: Any, expected: Any, values: bool = True, device: str = "pjrt") -> None:
    """Raise Wrong unless a result (on `device`) matches CPU's, leaf by leaf."""
    actual_leaves, expected_leaves = pytree.tree_leaves(actual), pytree.tree_leaves(expected)
    if len(actual_leaves) != len(expected_leaves):
        raise Wrong(f"{len(actual_leaves)} results, expected {len(expected_leaves)}")
    for a, e in zip(actual_leaves, expected_leaves):
        if not isinstance(e, torch.Tensor):
            if a != e and not (a != a and e != e):
                raise Wrong(f"{a!r} != {e!r}")
            continue
        if not isinstance(a, torch.Tensor):
            raise Wrong(f"a {type(a).__name__}, expected a tensor")
        if e.device.type == "cpu" and a.device.type != device:
            raise Wrong(f"result on {a.device}, expected {device}")
        if a.shape != e.shape or a.dtype != e.dtype:
            raise Wrong(f"{a.dtype}{list(a.shape)}, expected {e.dtype}{list(e.shape)}")
        if values:
            _compare_values(a.detach().cpu(), e.detach())


def _compare_values(a: torch.Tensor, e: torch.Tensor) -> None:
    try:
        torch.testing.assert_close(a, e, equal_nan=True, check_stride=False, **RELAXED.get(e.dtype, {}))
    except AssertionError as error:
        try:
            torch.testing.assert_close(a, e, equal_nan=True, check_stride=False, check_dtype=False, **LOOSE)
            near = True
        except AssertionError:
            near = False
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise Wrong("; ".join(lines[1:4])[:280], near) from None


def _differentiable(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.requires_grad]


def _loss(outputs: list[torch.Tensor]) -> torch.Tensor:
    """A weighted sum of the outputs, the same weights on both devices: a plain sum has an exact zero gradient
    for normalising ops (softmax, layer_norm) and would compare rounding noise against zero."""
    generator = torch.Generator().manual_seed(0)
    total = 0
    for output in outputs:
        real = torch.view_as_real(output) if output.is_complex() else output
        weights = torch.rand(real.shape, generator=generator, dtype=real.dtype) + 0.5
        total = total + (real * weights.to(real.device)).sum()
    return total


def _reference(fn: Callable[[], Any], random: bool) -> tuple[Any, bool]:
    """CPU's result, and whether values can be compared: not for random entries, nor for samples whose result
    changes with the seed (a dropout_p > 0 sample of an otherwise deterministic op, as in attention)."""
    try:
        torch.manual_seed(0)
        expected = fn()
        if random:
            return expected, False
        torch.manual_seed(1)
        again = fn()
    except Exception as error:
        raise CpuError(error) from error
    try:
        compare(again, expected, values=True, device="cpu")
    except Wrong:
        return expected, False
    return expected, True


def run_forward(op: Any, sample: Any, random: bool, record: Callable[[Any], Any] | None = None) -> None:
    """One forward sample; `record` (collects the aten ops it calls) gets a CPU run of its own, since
    under a dispatch mode some CPU kernels take other paths (complex pinv gives other values)."""
    moved = on_pjrt(sample, op.name)
    call = lambda s: s.output_process_fn_grad(op(s.input, *s.args, **s.kwargs))
    if record:
        with contextlib.suppress(Exception):
            record(lambda: call(sample))
    expected, values = _reference(lambda: call(sample), random)
    with torch.device("pjrt"):  # a factory sample without a device argument (linspace(1, 3, 1))
        actual = call(moved)
    if op.name in FIRST_OUTPUT_ONLY:
        actual, expected = actual[0], expected[0]
    try:
        compare(actual, expected, values=values)
    except Wrong:
        exact = lambda: call(_widened(sample, op.name))
        if not values or not _as_exact_as_cpu(actual, expected, exact, op.name):
            raise


def _widened(sample: Any, name: str) -> Any:
    """The sample with its floating tensors in double precision (WIDER)."""
    return sample.transform(lambda v: _copy(v, name, "cpu", WIDER[v.dtype])
                            if isinstance(v, torch.Tensor) and v.dtype in WIDER else v)


def _as_exact_as_cpu(actual: Any, expected: Any, exact_fn: Callable[[], Any], name: str) -> bool:
    """Whether every result that misses CPU's is a floating one about as close as CPU's to the same op run in
    double precision: two roundings of one value (CPU rounds some intermediates to half precision; its float32
    addbmm adds every product into a running sum far larger than some elements of the result)."""
    try:
        exact = exact_fn()
    except Exception:
        return False
    if name in FIRST_OUTPUT_ONLY:
        exact = exact[0]
    leaves = [pytree.tree_leaves(value) for value in (actual, expected, exact)]
    if len({len(found) for found in leaves}) != 1:
        return False
    for a, e, x in zip(*leaves):
        try:
            compare(a, e)
            continue
        except Wrong:
            pass
        try:
            compare(a, e, values=False)
        except Wrong:
            return False
        if e.dtype not in WIDER or not isinstance(x, torch.Tensor) or x.shape != e.shape:
            return False
        if not _within_slack(a.detach().cpu(), e.detach(), x.detach()):
            return False
    return True


def _within_slack(actual: torch.Tensor, expected: torch.Tensor, exact: torch.Tensor) -> bool:
    """Whether pjrt's values are within EXACT_SLACK of CPU's distance to the exact ones; an inf or nan must be
    CPU's too."""
    wide = torch.complex128 if expected.is_complex() else torch.float64
    a, e, x = (t.to(wide) for t in (actual, expected, exact))
    finite = a.isfinite() & e.isfinite() & x.isfinite()
    if not bool((finite | (a == e) | (a.isnan() & e.isnan())).all()):
        return False
    return _largest((a - x)[finite]) <= EXACT_SLACK * _largest((e - x)[finite])


def _largest(difference: torch.Tensor) -> float:
    return difference.abs().max().item() if difference.numel() else 0.0


def run_backward(op: Any, sample: Any, random: bool) -> None:
    """One gradient sample: d(sum of outputs)/d(inputs) on pjrt against CPU (shapes only for random ones)."""
    moved = on_pjrt(sample, op.name)

    def grads(s: Any) -> tuple[Any, ...] | None:
        inputs = _differentiable((s.input, s.args, s.kwargs))
        outputs = _differentiable(s.output_process_fn_grad(op(s.input, *s.args, **s.kwargs)))
        if not inputs or not outputs:
            return None
        return torch.autograd.grad(_loss(outputs), inputs, allow_unused=True)

    expected, values = _reference(lambda: grads(sample), random)
    if expected is not None:
        compare(grads(moved), expected, values=values)


class CpuError(Exception):
    """The CPU reference itself failed on a sample: the sample says nothing about pjrt."""


# --- one entry -------------------------------------------------------------------------------


class AtenRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Collects the aten ops a CPU reference run dispatches (maps OpInfo entries to aten names)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.add(func._schema.name)
        return func(*args, **(kwargs or {}))

    def run(self, fn: Callable[[], Any]) -> Any:
        with self:
            return fn()


def run_cell(op: Any, key: str, dtype: str, direction: str, max_samples: int | None,
             recorder: AtenRecorder | None = None, tick: Callable[[], None] | None = None) -> dict[str, Any]:
    """Every sample of one (entry, dtype, direction), or the first max_samples (then "capped" says whether
    more were left); the worst sample decides the status."""
    started = time.perf_counter()
    row: dict[str, Any] = {"key": key, "dtype": dtype, "direction": direction}
    reason = skip_reason(key, dtype)
    if reason:
        return {**row, "status": "skip", "detail": reason, "passed": 0, "total": 0, "capped": False, "seconds": 0.0}
    random = is_random(key, op)
    backward = direction == "backward"
    outcomes: dict[str, list[str]] = {s: [] for s in STATUS_ORDER}
    cpu_errors = 0
    far = 0
    capped = False
    try:
        samples = op.sample_inputs("cpu", DTYPES[dtype], requires_grad=backward)
        for index, sample in enumerate(samples):
            if max_samples is not None and index >= max_samples:
                capped = True
                break
            outcome, detail, near = _one_sample(op, sample, random, backward, recorder)
            far += outcome == "fail-wrong" and not near
            if tick:
                tick()
            if outcome == "cpu-error":
                cpu_errors += 1
            else:
                outcomes[outcome].append(detail)
    except Exception as error:
        outcomes["fail-error"].append("sample_inputs: " + _first_line(error))
    total = sum(len(v) for v in outcomes.values())
    status = next((s for s in STATUS_ORDER if outcomes[s]), "skip")
    detail = outcomes[status][0] if status not in ("pass", "skip") else ""
    if status == "skip":
        detail = f"no sample runs on CPU ({cpu_errors} raised)" if cpu_errors else "no samples"
    if status == "fail-wrong":
        row["near"] = far == 0
    return {**row, "status": status, "detail": detail, "passed": len(outcomes["pass"]), "total": total,
            "capped": capped, "random": random, "seconds": round(time.perf_counter() - started, 2)}


def _one_sample(op: Any, sample: Any, random: bool, backward: bool,
                recorder: AtenRecorder | None) -> tuple[str, str, bool]:
    try:
        if backward:
            run_backward(op, sample, random)
        else:
            run_forward(op, sample, random, recorder.run if recorder else None)
    except CpuError:
        return "cpu-error", "", False
    except Wrong as error:
        return "fail-wrong", str(error), error.near
    except NotImplementedError as error:
        return "unsupported", _first_line(error), False
    except Exception as error:
        return "fail-error", _first_line(error), False
    return "pass", "", False


def run_entry(op: Any, key: str, dtypes: Iterable[str], max_samples: int | None = None,
              tick: Callable[[], None] | None = None) -> Iterator[dict[str, Any]]:
    """Rows for every cell of one entry; the first row is the plan, the first result carries the aten names."""
    planned = cells(op, dtypes)
    yield {"key": key, "event": "plan", "cells": planned, "aten_name": op.aten_name}
    for dtype, direction in planned:
        recorder = AtenRecorder() if direction == "forward" else None
        row = run_cell(op, key, dtype, direction, max_samples, recorder, tick)
        if recorder is not None:
            row["aten"] = sorted(recorder.names)
        yield row


# --- the worker process ----------------------------------------------------------------------


def worker_main(dtypes: list[str], max_samples: int | None) -> None:
    """Read entry keys on stdin, write JSON rows on the original stdout (ops' own prints go to stderr)."""
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    torch.set_num_threads(1)
    import torch_pjrt  # noqa: F401  (registers the device even when autoload is off)

    entries = load_entries()
    emit = lambda row: results.write(json.dumps(row) + "\n")
    emit({"event": "ready"})
    for line in sys.stdin:
        key = line.strip()
        try:
            for row in run_entry(entries[key], key, dtypes, max_samples, lambda: emit({"event": "tick"})):
                emit(row)
        except Exception:
            traceback.print_exc()
            emit({"key": key, "dtype": "*", "direction": "*", "status": "fail-error", "passed": 0, "total": 0,
                  "detail": "battery: " + traceback.format_exc().strip().splitlines()[-1][:280]})
        emit({"key": key, "event": "done"})


# --- the pool --------------------------------------------------------------------------------


class Worker:
    """One worker subprocess and a thread turning its output into a queue of lines (None at EOF)."""

    def __init__(self, command: list[str], log: Any) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TORCH_PJRT_CPU_FALLBACK"}
        self.process = subprocess.Popen([sys.executable, *command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=log, text=True, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.handled = 0

    def _pump(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def read(self, timeout: float) -> dict[str, Any] | None:
        """The next row, or None when the worker died or said nothing for `timeout` seconds."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return None
        return None if line is None else json.loads(line)

    def send(self, key: str) -> None:
        self.process.stdin.write(key + "\n")
        self.process.stdin.flush()
        self.handled += 1

    def why_dead(self) -> str:
        code = self.process.poll()
        if code is None:
            return f"timeout: no progress for {IDLE_TIMEOUT:.0f} s"
        return f"worker died (signal {-code})" if code < 0 else f"worker exited with status {code}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


class Pool:
    """Runs entry keys over `jobs` workers (`python COMMAND...`, reading keys on stdin and writing rows as
    worker_main does); calls `sink` with every result row."""

    def __init__(self, jobs: int, command: list[str], log_path: str, sink: Callable[[dict[str, Any]], None],
                 deadline: float = float("inf")) -> None:
        self.jobs, self.command, self.deadline = jobs, command, deadline
        self.started: list[str] = []
        self.log = open(log_path, "a")
        self.sink = sink
        self.lock = threading.Lock()
        self.todo: queue.Queue[str] = queue.Queue()

    def run(self, keys: list[str]) -> None:
        for key in keys:
            self.todo.put(key)
        threads = [threading.Thread(target=self._drive) for _ in range(self.jobs)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.log.close()

    def _start(self) -> Worker | None:
        worker = Worker(self.command, self.log)
        ready = worker.read(START_TIMEOUT)
        if ready is None or ready.get("event") != "ready":
            worker.stop()
            return None
        return worker

    def _drive(self) -> None:
        worker: Worker | None = None
        while time.time() < self.deadline:
            try:
                key = self.todo.get_nowait()
            except queue.Empty:
                break
            self.started.append(key)
            if worker is not None and worker.handled >= RESTART_EVERY:
                worker.stop()
                worker = None
            worker = worker or self._start()
            if worker is None:
                self._emit({"key": key, "dtype": "*", "direction": "*", "status": "crash", "passed": 0,
                            "total": 0, "detail": "worker failed to start"})
                continue
            worker.send(key)
            if not self._collect(worker, key):
                worker.stop()
                worker = None
        if worker is not None:
            worker.process.stdin.close()
            worker.stop()

    def _collect(self, worker: Worker, key: str) -> bool:
        """Forward one entry's rows; False (after recording crashes) if the worker died or hung. A tick may
        say what it starts (`at`): a crash row then names it."""
        planned: list[tuple[str, str]] = []
        done: set[tuple[str, str]] = set()
        at = None
        while True:
            row = worker.read(IDLE_TIMEOUT)
            if row is None:
                why = worker.why_dead() + (f" (during {at})" if at else "")
                for dtype, direction in [c for c in planned if c not in done] or [("*", "*")]:
                    self._emit({"key": key, "dtype": dtype, "direction": direction, "status": "crash",
                                "passed": 0, "total": 0, "detail": why})
                return False
            event = row.get("event")
            if event == "done":
                return True
            if event == "tick":
                at = row.get("at")
                continue
            if event == "plan":
                planned = [tuple(c) for c in row["cells"]]
                self._emit(row)
                continue
            done.add((row.get("dtype"), row.get("direction")))
            self._emit(row)

    def _emit(self, row: dict[str, Any]) -> None:
        with self.lock:
            self.sink(row)


# --- the command line ------------------------------------------------------------------------


def _select(entries: dict[str, Any], names: list[str] | None) -> list[str]:
    """Keys matching --ops: an exact key, else every key of that OpInfo name, else substrings."""
    if not names:
        return sorted(entries)
    chosen: list[str] = []
    for name in names:
        matches = ([name] if name in entries else [k for k in entries if entries[k].name == name]
                   or [k for k in entries if name in k])
        if not matches:
            raise SystemExit(f"no OpInfo entry matches {name!r}")
        chosen += [k for k in matches if k not in chosen]
    return sorted(chosen)


def _replaced(row: dict[str, Any], keys: set[str], dtypes: set[str]) -> bool:
    """Whether this run replaces an old row: same entry, and a dtype it runs (or the entry's plan)."""
    return row.get("key") in keys and (row.get("event") == "plan" or row.get("dtype") in dtypes | {"*"})


def read_rows(path: str) -> list[dict[str, Any]]:
    """Result rows of a JSON-lines file (gzip-compressed when the name ends in .gz)."""
    if not os.path.exists(path):
        return []
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m battery.run_opinfo", description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="+", help="OpInfo names, keys (name.variant) or substrings; default all")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default=DEFAULT_OUT, help="JSON lines of results (rows of rerun entries replaced)")
    parser.add_argument("--max-samples", type=int, help="at most this many samples per cell (quick looks)")
    parser.add_argument("--report", action=argparse.BooleanOptionalAction, default=None,
                        help="rewrite docs/op-coverage.md and the shipped JSON from --out (default: on full runs)")
    parser.add_argument("--time-limit", type=float, help="start no entry after this many minutes (a partial run)")
    parser.add_argument("--shuffle", action="store_true", help="random entry order (a run cut short is a fair sample)")
    parser.add_argument("--fresh", action="store_true", help="start --out empty instead of merging into it")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args.dtypes, args.max_samples)
        return
    keys = _select(load_entries(), args.ops)
    if args.shuffle:
        random.shuffle(keys)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    kept = [] if args.fresh else [r for r in read_rows(args.out) if not _replaced(r, set(keys), set(args.dtypes))]
    started = time.time()
    with open(args.out, "w") as out:
        for row in kept:
            out.write(json.dumps(row) + "\n")
        progress = Progress(len(keys), out)
        deadline = started + 60 * args.time_limit if args.time_limit else float("inf")
        command = ["-m", "battery.run_opinfo", "--worker", "--dtypes", *args.dtypes]
        if args.max_samples is not None:
            command += ["--max-samples", str(args.max_samples)]
        pool = Pool(args.jobs, command, args.out + ".log", progress.sink, deadline)
        pool.run(keys)
    run = {"entries": len(pool.started), "seconds": round(time.time() - started, 1), "jobs": args.jobs,
           "dtypes": args.dtypes, "max_samples": args.max_samples,
           "all_entries": not args.ops and len(pool.started) == len(keys),
           "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    meta = {} if args.fresh or not os.path.exists(args.out + ".meta.json") else json.load(open(args.out + ".meta.json"))
    meta = {"torch": torch.__version__, "runs": meta.get("runs", []) + [run]}
    with open(args.out + ".meta.json", "w") as f:
        json.dump(meta, f, indent=1)
    print(f"{len(pool.started)} of {len(keys)} entries in {run['seconds']:.0f} s -> {args.out}", file=sys.stderr)
    if args.report or (args.report is None and not args.ops and args.max_samples is None):
        from battery import report

        report.main([args.out, "--save-rows", report.ROWS_PATH])


class Progress:
    """Writes rows to the results file and tells the terminal about entries done and cells not passing."""

    def __init__(self, total: int, out: Any) -> None:
        self.total, self.out, self.done = total, out, 0

    def sink(self, row: dict[str, Any]) -> None:
        self.out.write(json.dumps(row) + "\n")
        self.out.flush()
        if row.get("event") == "plan":
            self.done += 1
            print(f"[{self.done}/{self.total}] {row['key']}", file=sys.stderr)
        elif row["status"] != "pass":
            text = f"    {row['key']} {row['dtype']} {row['direction']}: {row['status']} {row.get('detail', '')}"
            print(text[:160], file=sys.stderr)


if __name__ == "__main__":
    main()

"""`torch-pjrt zoo`: run a zoo of models on pjrt against CPU before migrating, one row per model.

Each model (a Hugging Face architecture shrunk to a small size with random weights, a timm image model
with random weights, a diffusers model class shrunk likewise (zoo_diffusers), or a user's own factory;
see zoo_catalog) is built on CPU in float32, copied to pjrt, and run on both: the forward outputs are
compared, then one training step (loss, backward, SGD step) and the next step's loss.
Models run in worker subprocesses (`--jobs`), so one that crashes or hangs costs only its own row.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import datetime
import json
import os
import platform
import queue
import re
import select
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torch_pjrt import _torch_private
from torch_pjrt.cli import zoo_catalog, zoo_diffusers
from torch_pjrt.cli.run import MISSING_LOWERING
from torch_pjrt.cli.zoo_catalog import Case, Skip, first_line

MODES = ("strict", "fused", "compile")
# float32 on XLA's CPU backend against torch's CPU kernels: elementwise |pjrt - cpu| <= atol + rtol * |cpu|.
FORWARD_TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}
TRAINING_TOLERANCE = {"rtol": 1e-3, "atol": 1e-4}  # the loss, every gradient, the loss after one SGD step
# A float32 value outside those tolerances still matches when pjrt's RMS error against a float64 run of the same
# model on CPU is at most this multiple of CPU float32's own RMS error, plus atol/10: a random-weight model whose
# activations grow large has float32 rounding error of its own that no fixed tolerance bounds. The criterion and
# its numbers are those of PyTorch's benchmark suites (torch._dynamo.utils.same with an fp64 reference).
FLOAT64_MULTIPLIER = 2.0
FLOAT64_MULTIPLIER_SMALL = 3.0  # tensors under FLOAT64_SMALL_TENSOR elements, where noise dominates the RMS
FLOAT64_SMALL_TENSOR = 1000
LEARNING_RATE = 0.1
DEFAULT_TIMEOUT = 300.0
CASES_PER_WORKER = 50  # a worker is replaced after this many models, so its caches do not grow without bound
STATUSES = ("match", "mismatch", "error", "skipped", "not run")


# --- one model ----------------------------------------------------------------------------------


def _tensors(value: Any, name: str = "output") -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors in a model's output (ModelOutput, dict, tuple, tensor), with their paths."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{name}.{key}" if name != "output" else key)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{name}[{index}]")


def _loss(output: Any) -> torch.Tensor:
    """The model's own loss where it returns one, else the mean square of its first float output."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.reshape(())
    for _, tensor in _tensors(output):
        if tensor.is_floating_point() and (tensor.requires_grad or not torch.is_grad_enabled()):
            return tensor.float().square().mean()
    raise Skip("the model returns no loss and no differentiable float output to train on")


def _to(value: Any, device: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: _to(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to(item, device) for item in value)
    return value


def _call(model: torch.nn.Module, inputs: Any) -> Any:
    """The model on its inputs. A torch.Generator among them is re-seeded first, so a model that samples
    noise in its forward (a consistency decoder) draws the same numbers at every call on every device."""
    for value in inputs.values() if isinstance(inputs, dict) else inputs:
        if isinstance(value, torch.Generator):
            value.manual_seed(0)
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


@dataclasses.dataclass
class Step:
    """What one device produced: forward outputs, loss, gradients, the loss after one SGD step."""

    outputs: dict[str, torch.Tensor]
    loss: torch.Tensor
    gradients: dict[str, torch.Tensor]
    next_loss: torch.Tensor


class PjrtFailure(Exception):
    """The pjrt side raised: `phase` says in which part of the step."""

    def __init__(self, phase: str, error: BaseException) -> None:
        super().__init__(f"{phase}: {first_line(error)}")
        self.phase, self.error = phase, error


def _train_step(model: torch.nn.Module, inputs: Any, device: str, run: Callable[[Any], Any]) -> Step:
    """Forward, backward, one SGD step and a second forward; tensors come back to CPU. On CPU FlexAttention
    differentiates too (PyTorch's device check alone refuses it there)."""
    phase = "forward"
    try:
        with _torch_private.flex_attention_backward_on_cpu() if device != "pjrt" else contextlib.nullcontext():
            output = run(inputs)
            outputs = {name: t.detach().cpu() for name, t in _tensors(output)}
            phase = "backward"
            loss = _loss(output)
            loss.backward()
            gradients = {name: p.grad.detach().cpu() for name, p in model.named_parameters() if p.grad is not None}
            phase = "optimizer step"
            torch.optim.SGD(model.parameters(), lr=LEARNING_RATE).step()
            phase = "second forward"
            with torch.no_grad():
                next_loss = _loss(run(inputs)).detach().cpu()
            return Step(outputs, loss.detach().cpu(), gradients, next_loss)
    except Skip:
        raise
    except Exception as error:
        if device == "cpu":
            raise Skip(f"the CPU reference fails in its {phase}: {first_line(error)}") from None
        raise PjrtFailure(phase, error) from error


def _max_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.dtype == torch.bool:
        actual, expected = actual.int(), expected.int()
    difference = (actual.double() - expected.double()).abs()
    both_nan = actual.isnan() & expected.isnan() if actual.is_floating_point() else None
    if both_nan is not None:
        difference = difference.masked_fill(both_nan, 0)
    return float(difference.nan_to_num(float("inf")).max()) if difference.numel() else 0.0


def _compare(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
             tolerance: dict[str, float]) -> tuple[float, str | None]:
    """(largest difference, the first tensor outside tolerance or None)."""
    largest, worst = 0.0, None
    for name, want in expected.items():
        got = actual.get(name)
        if got is None or got.shape != want.shape or got.dtype != want.dtype:
            got_what = "missing" if got is None else f"{got.dtype} {tuple(got.shape)}"
            return float("inf"), f"{name}: {got_what} on pjrt, {want.dtype} {tuple(want.shape)} on CPU"
        difference = _max_difference(got, want)
        largest = max(largest, difference)
        if worst is None and not _within(got, want, tolerance):
            worst = f"{name}: max abs diff {difference:.3g}"
    return largest, worst


def _float64_step(model: torch.nn.Module, inputs: Any) -> Step:
    """The same training step on CPU in float64 (model and float inputs): the reference for rounding error."""
    model = model.double()
    inputs = _to_float64(inputs)
    return _train_step(model, inputs, "cpu float64", lambda i: _call(model, i))


def _to_float64(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if isinstance(value, dict):
        return {key: _to_float64(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_float64(item) for item in value)
    return value


def _within(got: torch.Tensor, want: torch.Tensor, tolerance: dict[str, float]) -> bool:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if not got.is_floating_point():
        return torch.equal(got, want)
    return bool(torch.isclose(got, want, equal_nan=True, **tolerance).all())


@contextlib.contextmanager
def _mode(mode: str) -> Iterator[None]:
    """The pjrt side's execution mode (compile is applied to the model itself)."""
    from torch_pjrt.eager import fusion, modes

    if mode != "fused":
        yield
        return
    with modes.set_eager_mode(modes.EagerMode.DEFER_AND_FUSE):
        yield
        fusion.flush("zoo step")


def build_case(case: Case) -> tuple[torch.nn.Module, Any]:
    """The case's CPU model and inputs; any failure here is the zoo's or the model's, not pjrt's (Skip)."""
    try:
        if case.library == "timm":
            return zoo_catalog.build_timm(case)
        if case.library == "diffusers":
            return zoo_diffusers.build_diffusers(case)
        return zoo_catalog.build_user(case) if case.factory else zoo_catalog.build_hf(case)
    except Skip:
        raise
    except Exception as error:
        raise Skip(f"building it on CPU fails: {first_line(error)}") from None


def run_case(case: Case, mode: str = "strict") -> dict[str, Any]:
    """Build, run and compare one model; the row says match, mismatch, error or skipped, and why."""
    import torch_pjrt  # noqa: F401  (registers the device when autoload is off)

    row: dict[str, Any] = {"key": case.key, "family": case.family, "task": case.task,
                           "model_class": case.model_class or case.factory, "mode": mode}
    started = time.perf_counter()
    try:
        torch.manual_seed(0)
        model, inputs = build_case(case)
        row["parameters"] = sum(p.numel() for p in model.parameters())
        on_pjrt = copy.deepcopy(model).to("pjrt")  # as a user moves it (ties kept: module_moves.py)
        pjrt_inputs = _to(inputs, "pjrt")
        pristine = copy.deepcopy(model)  # for the float64 reference, built only when a value is outside tolerance
        expected = _train_step(model, inputs, "cpu", lambda i: _call(model, i))
        forward = torch.compile(on_pjrt, backend="pjrt") if mode == "compile" else on_pjrt
        with _mode(mode):
            actual = _train_step(on_pjrt, pjrt_inputs, "pjrt", lambda i: _call(forward, i))
        row.update(_judge(actual, expected, lambda: _float64_step(pristine, inputs)))
    except Skip as why:
        row.update(status="skipped", detail=str(why))
    except PjrtFailure as failure:
        missing = MISSING_LOWERING.search(str(failure.error))
        row.update(status="error", detail=str(failure), phase=failure.phase)
        if missing:
            row["unsupported_op"] = missing.group(1)
    except Exception as error:  # building on pjrt (`.to("pjrt")`, the inputs' copy) failed
        row.update(status="error", detail=f"moving to pjrt: {first_line(error)}", phase="to pjrt")
    finally:
        if mode == "compile":
            torch._dynamo.reset()
    row["seconds"] = round(time.perf_counter() - started, 2)
    return row


def _judge(actual: Step, expected: Step, float64: Callable[[], Step]) -> dict[str, Any]:
    """Fixed tolerances first; a tensor outside them still matches when pjrt's error against a float64 CPU
    run (`float64()`, run only then) is within FLOAT64_MULTIPLIER times CPU float32's own error."""
    forward, forward_worst = _compare(actual.outputs, expected.outputs, FORWARD_TOLERANCE)
    training, training_worst = _compare(_training_values(actual), _training_values(expected), TRAINING_TOLERANCE)
    row = {"forward_max_diff": forward, "training_max_diff": training, "loss": float(expected.loss)}
    if not forward_worst and not training_worst:
        return {"status": "match", "detail": "", **row}
    try:
        reference = float64()
    except Exception as error:
        worst = f"forward {forward_worst}" if forward_worst else f"training step {training_worst}"
        return {"status": "mismatch", "detail": f"{worst}; the float64 CPU run fails: {first_line(error)}", **row}
    verdicts = [("forward", *_float64_verdict(actual.outputs, expected.outputs, reference.outputs,
                                              FORWARD_TOLERANCE)),
                ("training step", *_float64_verdict(_training_values(actual), _training_values(expected),
                                                    _training_values(reference), TRAINING_TOLERANCE))]
    failing = [(phase, text) for phase, text, passed in verdicts if text and not passed]
    if failing:
        return {"status": "mismatch", "detail": f"{failing[0][0]} {failing[0][1]}", **row}
    phase, text, _ = next(v for v in verdicts if v[1])
    return {"status": "match", "detail": f"by the float64 criterion: {phase} {text}", "float64_criterion": True,
            **row}


def _training_values(step: Step) -> dict[str, torch.Tensor]:
    return {"loss": step.loss, "next step loss": step.next_loss, **step.gradients}


def _rms_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.double() - reference.double()).square().mean().sqrt())


def _float64_verdict(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                     reference: dict[str, torch.Tensor], tolerance: dict[str, float]) -> tuple[str, bool]:
    """Over the float tensors outside `tolerance`: (the one furthest past the float64 criterion, or the
    closest to failing it when all pass, as text; whether all pass). ("", True) when none is outside."""
    worst_text, worst_ratio, passed = "", -1.0, True
    for name, want in expected.items():
        got, exact = actual.get(name), reference.get(name)
        if got is not None and _within(got, want, tolerance):
            continue
        if got is None or got.shape != want.shape or exact is None or exact.shape != want.shape \
                or not want.is_floating_point():
            return f"{name}: outside tolerance and no float64 value to judge it by", False
        pjrt_error, cpu_error = _rms_error(got, exact), _rms_error(want, exact)
        multiplier = FLOAT64_MULTIPLIER if want.numel() >= FLOAT64_SMALL_TENSOR else FLOAT64_MULTIPLIER_SMALL
        bound = multiplier * cpu_error + tolerance["atol"] / 10
        ok = pjrt_error <= bound or (pjrt_error != pjrt_error and cpu_error != cpu_error)  # both NaN: both broke
        ratio = pjrt_error / bound if bound > 0 else float("inf")
        if (not ok and passed) or (ok == passed and ratio > worst_ratio):
            worst_ratio, passed = ratio, passed and ok
            worst_text = (f"{name}: rms error against float64 CPU {pjrt_error:.3g} on pjrt, {cpu_error:.3g} on "
                          f"CPU float32 (bound {bound:.3g})")
    return worst_text, passed


# --- worker processes -------------------------------------------------------------------------------


def worker_main(mode: str) -> None:
    """Read cases (JSON lines) on stdin, write result rows on the original stdout; prints go to stderr."""
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    torch.set_num_threads(1)
    import torch_pjrt  # noqa: F401

    results.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        case = Case(**json.loads(line))
        print(f"zoo: {case.key}", file=sys.stderr, flush=True)
        results.write(json.dumps(run_case(case, mode)) + "\n")


class Worker:
    """A worker subprocess: one case in on stdin, one JSON row back on stdout, waited for with a timeout."""

    def __init__(self, mode: str, log: Any) -> None:
        environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                       "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"}
        environment.pop("TORCH_PJRT_CPU_FALLBACK", None)
        self.process = subprocess.Popen([sys.executable, "-m", "torch_pjrt.cli.zoo", "--worker", mode],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=environment)
        self.unread = b""
        self.cases_run = 0

    def result(self, timeout: float) -> dict[str, Any] | str:
        """The next row, or why there is none (the worker died, or said nothing for `timeout` s)."""
        give_up = time.monotonic() + timeout
        while b"\n" not in self.unread:
            left = give_up - time.monotonic()
            if left <= 0 or not select.select([self.process.stdout], [], [], left)[0]:
                return f"timeout: no result in {timeout:.0f} s"
            chunk = os.read(self.process.stdout.fileno(), 1 << 16)
            if not chunk:
                code = self.process.wait()
                return f"the worker process died (signal {-code})" if code < 0 else f"the worker exited ({code})"
            self.unread += chunk
        line, _, self.unread = self.unread.partition(b"\n")
        return json.loads(line)

    def submit(self, case: Case) -> None:
        self.process.stdin.write(json.dumps(dataclasses.asdict(case)).encode() + b"\n")
        self.process.stdin.flush()
        self.cases_run += 1

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def run_cases(cases: list[Case], mode: str = "strict", jobs: int = 1, timeout: float = DEFAULT_TIMEOUT,
              isolate: bool = True, deadline: float = float("inf"), log_path: str = os.devnull,
              on_row: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Rows for `cases` in their order: in `jobs` worker subprocesses, or in this process with
    `isolate=False`. Cases not started by `deadline` (a time.time()) get status "not run"."""
    rows: dict[int, dict[str, Any]] = {}
    lock = threading.Lock()

    def record(index: int, row: dict[str, Any]) -> None:
        with lock:
            rows[index] = row
            if on_row:
                on_row(row)

    todo: queue.Queue[int] = queue.Queue()
    for index in range(len(cases)):
        todo.put(index)
    if not isolate:
        while not todo.empty():
            index = todo.get()
            record(index, run_case(cases[index], mode) if time.time() < deadline else _not_run(cases[index]))
        return [rows[i] for i in range(len(cases))]
    with open(log_path, "a") as log:
        threads = [threading.Thread(target=_drive, args=(cases, todo, mode, timeout, deadline, log, record))
                   for _ in range(max(1, jobs))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return [rows[i] for i in range(len(cases))]


def _not_run(case: Case) -> dict[str, Any]:
    return {"key": case.key, "family": case.family, "task": case.task,
            "model_class": case.model_class or case.factory, "status": "not run", "detail": "time budget spent"}


def _drive(cases: list[Case], todo: queue.Queue[int], mode: str, timeout: float, deadline: float, log: Any,
           record: Callable[[int, dict[str, Any]], None]) -> None:
    """One job: feed cases to a worker, replacing it when it dies, hangs or has run its share."""
    worker: Worker | None = None
    while True:
        try:
            index = todo.get_nowait()
        except queue.Empty:
            break
        case = cases[index]
        if time.time() >= deadline:
            record(index, _not_run(case))
            continue
        if worker is not None and worker.cases_run >= CASES_PER_WORKER:
            worker.process.stdin.close()
            worker.stop()
            worker = None
        if worker is None:
            worker = Worker(mode, log)
            ready = worker.result(timeout)
            if not isinstance(ready, dict):
                worker.stop()
                worker = None
                record(index, {**_not_run(case), "status": "error", "detail": f"worker failed to start: {ready}"})
                continue
        worker.submit(case)
        result = worker.result(timeout)
        if isinstance(result, dict):
            record(index, result)
            continue
        worker.stop()
        worker = None
        record(index, {**_not_run(case), "status": "error", "detail": result, "phase": "crash or hang"})
    if worker is not None:
        worker.process.stdin.close()
        worker.stop()


# --- selection ---------------------------------------------------------------------------------------


def select_cases(tasks: list[str] | None = None, families: list[str] | None = None, name: str | None = None,
                 user_models: list[str] | None = None, library: str = "transformers") -> list[Case]:
    """The cases to run: user factories when given, else the library's architectures, filtered."""
    if user_models:
        cases = [c for spec in user_models for c in zoo_catalog.user_cases(spec)]
    else:
        cases = (zoo_catalog.timm_cases(families) if library == "timm" else
                 zoo_diffusers.diffusers_cases() if library == "diffusers" else zoo_catalog.hf_cases(tasks))
    if families:
        cases = [c for c in cases if c.family in families]
    if name:
        pattern = re.compile(name)
        cases = [c for c in cases if pattern.search(c.key) or pattern.search(c.model_class)]
    return cases


# --- reports -----------------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    from importlib import metadata

    found = {}
    for package in ("torch", *zoo_catalog.LIBRARIES, "jax", "jaxlib", "torch-pjrt"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    found["python"] = platform.python_version()
    return found


def failure_cause(row: dict[str, Any]) -> str:
    """Rows with one cause share this text: the unsupported op, or the message with numbers elided."""
    if row.get("unsupported_op"):
        return f"no lowering for {row['unsupported_op']}"
    detail = row.get("detail", "")
    if row["status"] == "mismatch":
        return "mismatch in the " + ("forward outputs" if detail.startswith("forward") else "training step")
    return re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", detail)[:160]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    counts = collections.Counter(row["status"] for row in rows)
    causes: dict[str, list[str]] = collections.defaultdict(list)
    for row in rows:
        if row["status"] in ("error", "mismatch"):
            causes[failure_cause(row)].append(row["key"])
    ranked = sorted(causes.items(), key=lambda item: -len(item[1]))[:20]
    return {"models": len(rows), **{status: counts.get(status, 0) for status in STATUSES},
            "top_failure_causes": [{"cause": cause, "models": len(keys), "examples": keys[:4]}
                                   for cause, keys in ranked]}


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _difference(value: Any) -> str:
    return "" if value is None else f"{value:.2g}"


STATUS_CELLS = {"match": "match", "mismatch": "**MISMATCH**", "error": "**error**", "skipped": "skip",
                "not run": "·"}


def markdown(record: dict[str, Any]) -> str:
    """The report of one run (the record `--json` writes)."""
    rows = record["rows"]
    summary = summarize(rows)
    library = record.get("library", "transformers")
    built = (f"Each model is the one with the fewest parameters (counted on the meta device) of one of timm's "
             f"model modules (family = module), built by `timm.create_model` with random float32 weights (seed 0, "
             f"dropout and stochastic depth 0, {zoo_catalog.LABELS} classes; a module whose smallest model has over "
             f"{zoo_catalog.TIMM_MAX_PARAMETERS // 1_000_000}M parameters skipped), nothing downloaded; it runs in "
             f"eval mode on CPU and, deep-copied, on pjrt, with the same random images (batch {zoo_catalog.BATCH}, "
             f"the model's own size where it is fixed, else the smallest side from {zoo_catalog.TIMM_IMAGE} up in "
             f"steps of {zoo_catalog.TIMM_SIDE_STEP} at which its forward runs on the meta device); the training "
             "step's loss is the mean square of the logits. "
             if library == "timm" else
             "Each model is one of the model classes diffusers exports under `diffusers.models` (family = the kind "
             "its name says), built from its constructor's defaults with layer and block counts cut to "
             f"{zoo_diffusers.LAYERS} (1 per block), head counts to at most "
             f"{zoo_diffusers.HEADS} (kept where the model does not run with fewer: a width tied to heads x head "
             f"size), channel lists to widths {zoo_diffusers.CHANNELS} and "
             f"{zoo_diffusers.CHANNELS * 2} (and, for a model still over {zoo_diffusers.MAX_PARAMETERS // 1_000_000}M "
             f"parameters, hidden widths to {zoo_diffusers.WIDE}), the sizes "
             f"{len(zoo_diffusers.CONSTRUCTOR_OVERRIDES)} classes leave to a checkpoint or tie to others set by "
             "hand (`CONSTRUCTOR_OVERRIDES` in torch_pjrt/cli/zoo_diffusers.py), dropout 0, random float32 weights "
             "(seed 0; a "
             "constant matrix such as a zero-initialised output projection gets random values), nothing downloaded. "
             "Its inputs are synthesised from its forward's argument names and its config: latents "
             f"{zoo_diffusers.SIDE}x{zoo_diffusers.SIDE} as an image, a video "
             f"({' or '.join(map(str, zoo_diffusers.FRAMES))} frames), packed tokens, a 1-D signal or a vector, "
             "the first of these the model accepts on CPU, with random timesteps in [50, 950) (a ratio: / 1000; "
             "in [0, 1) for a model that multiplies them by 1000 itself, as its code or config says) and "
             f"{zoo_diffusers.TEXT_TOKENS} text-embedding tokens of the configured width (batch "
             f"{zoo_catalog.BATCH}); it runs in eval mode on CPU and, deep-copied, on pjrt; the training "
             "step's loss is the mean square of the first output. "
             if library == "diffusers" else
             "Each architecture is built from its config class's defaults shrunk to a small size (hidden 32, "
             "2 layers, 4 heads, vocabulary 96, images 32x32; dropout 0) with random float32 weights (seed 0; "
             "a weight matrix the model's init leaves constant gets random values too, so no ties decide routing), "
             "nothing downloaded; it runs in eval mode on CPU and, deep-copied, on pjrt, with the same synthetic "
             f"inputs (batch {zoo_catalog.BATCH}, {zoo_catalog.SEQUENCE} tokens, labels). ")
    by_float64 = sum(1 for row in rows if row.get("float64_criterion"))
    lines = [
        "# Model coverage: " + {"timm": "timm image models", "diffusers": "diffusers models"}.get(
            library, "Hugging Face architectures") + " on pjrt",
        "",
        f"Generated by `{record['command']}` on {record.get('date', '?')} in {record['seconds'] / 60:.1f} min; "
        + ", ".join(f"{k} {v}" for k, v in record["versions"].items()) + "."
        + (f" Rows replaced by a later run: {record['replaced']}." if record.get("replaced") else ""),
        "",
        built + "**match**: every forward output within "
        f"rtol {FORWARD_TOLERANCE['rtol']:g}/atol {FORWARD_TOLERANCE['atol']:g} of CPU, and the loss, every "
        f"gradient and the loss after one SGD step (lr {LEARNING_RATE:g}) within rtol "
        f"{TRAINING_TOLERANCE['rtol']:g}/atol {TRAINING_TOLERANCE['atol']:g}; a value outside these still "
        "matches by the float64 criterion of PyTorch's own benchmark suites when the same step run on CPU in "
        "float64 shows pjrt's RMS error against it at most "
        f"{FLOAT64_MULTIPLIER:g}x CPU float32's own ({FLOAT64_MULTIPLIER_SMALL:g}x for tensors under "
        f"{FLOAT64_SMALL_TENSOR} elements) plus atol/10 (a random-weight model whose activations grow large has "
        f"float32 rounding error no fixed tolerance bounds; {by_float64} models matched this way, their detail "
        "gives both errors). **mismatch**: a value outside "
        "them (the first named). **error**: pjrt raised, crashed or hung (the phase and first line). "
        "**skipped**: the zoo cannot run it (the config needs files or packages, or the shrunk model fails "
        "on CPU too): not a pjrt result.",
        "",
        "## Summary",
        "",
        "| status | models |",
        "|---|---|",
        *[f"| {status} | {summary[status]} |" for status in STATUSES if summary[status]],
        f"| all | {summary['models']} |",
        "",
    ]
    by_task: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for row in rows:
        by_task[row["task"]][row["status"]] += 1
    lines += ["| task | " + " | ".join(STATUSES) + " |", "|---|" + "---|" * len(STATUSES)]
    lines += [f"| {task} | " + " | ".join(str(c.get(s, 0)) for s in STATUSES) + " |" for task, c in by_task.items()]
    if summary["top_failure_causes"]:
        lines += ["", "## Top failure causes", "", "| cause | models | for example |", "|---|---|---|"]
        lines += [f"| {_cell(c['cause'])} | {c['models']} | {', '.join(c['examples'])} |"
                  for c in summary["top_failure_causes"]]
    reached = [row for row in rows if row["status"] != "not run"]
    tasks = list(dict.fromkeys(row["task"] for row in reached))
    cells: dict[str, dict[str, str]] = collections.defaultdict(dict)
    for row in rows:
        if row["task"] in tasks:
            cells[row["key"] if library == "diffusers" else row["family"]][row["task"]] = STATUS_CELLS[row["status"]]
    lines += ["", "## Per architecture", "", "One row per model type, one column per task (· not run, blank: "
              "transformers has no such head).", "", "| architecture | " + " | ".join(tasks) + " |",
              "|---|" + "---|" * len(tasks)]
    lines += [f"| {family} | " + " | ".join(cells[family].get(task, "") for task in tasks) + " |"
              for family in sorted(cells)]
    lines += ["", "## Every model", "",
              "| architecture | class | status | forward max diff | training max diff | s | detail |",
              "|---|---|---|---|---|---|---|"]
    if len(reached) < len(rows):
        lines[-2:-2] = [f"The {len(rows) - len(reached)} models not reached in the time budget are counted above, "
                        "not listed.", ""]
    for row in reached:
        lines.append(f"| {_cell(row['key'])} | {_cell(row['model_class'])} | {row['status']} | "
                     f"{_difference(row.get('forward_max_diff'))} | {_difference(row.get('training_max_diff'))} | "
                     f"{row.get('seconds', '')} | {_cell(row.get('detail', ''))} |")
    return "\n".join(lines) + "\n"


def merge(saved: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """`saved` (an earlier run's record) with `record`'s rows (a later run of some of its models) in place of its
    rows of the same key, new keys after; the header keeps the first run's command and says what replaced what."""
    later = {row["key"]: row for row in record["rows"]}
    rows = [later.pop(row["key"], row) for row in saved["rows"]] + list(later.values())
    note = (f"on {record['date']}, the {len(record['rows'])} rows of `{record['command']}` "
            f"({record['seconds'] / 60:.1f} min)")
    replaced = f"{saved['replaced']}. Then, {note}" if saved.get("replaced") else note
    return saved | {"rows": rows, "summary": summarize(rows), "replaced": replaced}


def _progress_line(done: list[int], total: int) -> Callable[[dict[str, Any]], None]:
    def show(row: dict[str, Any]) -> None:
        done[0] += 1
        detail = f"  {row.get('detail', '')[:110]}" if row["status"] != "match" else ""
        print(f"[{done[0]}/{total}] {row['key']:<45} {row['status']:<8} {row.get('seconds', '')}s{detail}",
              file=sys.stderr, flush=True)
    return show


def _invocation(args: argparse.Namespace) -> str:
    """The command line that selects these models, for the report's first line."""
    words = ["torch-pjrt", "zoo"] + (["--library", args.library] if args.library != "transformers" else [])
    for option in ("task", "family", "name", "mode", "jobs", "timeout", "budget_minutes", "limit"):
        value = getattr(args, option)
        if value is not None and value is not False:
            words += [f"--{option.replace('_', '-')}", str(value)]
    for spec in args.model or ():
        words += ["--model", spec]
    return shlex.join(words)


def _comma_list(text: str | None) -> list[str] | None:
    return [item.strip() for item in text.split(",") if item.strip()] if text else None


def command(args: argparse.Namespace) -> int:
    if args.from_json:
        if not args.report:
            print("torch-pjrt zoo: --from-json needs --report PATH to write", file=sys.stderr)
            return 2
        with open(args.from_json) as saved:
            record = json.load(saved)
        record.setdefault("date", datetime.date.fromtimestamp(os.path.getmtime(args.from_json)).isoformat())
        with open(args.report, "w") as out:
            out.write(markdown(record))
        return 0
    tasks = list(zoo_catalog.TASKS) if args.task == "all" else _comma_list(args.task)
    unknown = sorted(set(tasks or ()) - set(zoo_catalog.TASKS))
    if unknown:
        print(f"torch-pjrt zoo: unknown task {', '.join(unknown)}; use one of {', '.join(zoo_catalog.TASKS)}",
              file=sys.stderr)
        return 2
    try:
        cases = select_cases(tasks or ["causal-lm"], _comma_list(args.family), args.name, args.model, args.library)
    except (ValueError, ImportError, Skip, re.error) as error:
        print(f"torch-pjrt zoo: {error}", file=sys.stderr)
        return 2
    cases = cases[: args.limit] if args.limit else cases
    if args.list:
        print("\n".join(f"{c.key}  {c.model_class or c.factory}" for c in cases))
        return 0
    if not cases:
        print("torch-pjrt zoo: no model matches the filters (see --list)", file=sys.stderr)
        return 2
    started = time.time()
    deadline = started + args.budget_minutes * 60 if args.budget_minutes else float("inf")
    rows = run_cases(cases, args.mode, args.jobs, args.timeout, isolate=not args.in_process, deadline=deadline,
                     log_path=args.log, on_row=_progress_line([0], len(cases)))
    seconds = time.time() - started
    summary = summarize(rows)
    print(" ".join(f"{s}: {summary[s]}" for s in STATUSES) + f"  ({len(rows)} models, {seconds / 60:.1f} min)")
    record = {"command": _invocation(args), "library": args.library, "mode": args.mode,
              "date": datetime.date.today().isoformat(), "seconds": round(seconds, 1), "versions": versions(),
              "summary": summary, "rows": rows}
    if args.merge:
        with open(args.merge) as saved:
            record = merge(json.load(saved), record)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(record, out, indent=1)
    if args.report:
        with open(args.report, "w") as out:
            out.write(markdown(record))
    return 1 if summary["error"] or summary["mismatch"] else 0


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "zoo", help="Hugging Face architectures (shrunk, random weights), timm's or diffusers' models, or your own: "
             "pjrt against CPU")
    parser.add_argument("--library", choices=zoo_catalog.LIBRARIES, default="transformers",
                        help="whose models: Hugging Face transformers' architectures (default), timm's or diffusers'")
    parser.add_argument("--task", help="comma-separated tasks, or all (default causal-lm): "
                                       + ", ".join(zoo_catalog.TASKS))
    parser.add_argument("--family", help="comma-separated model types, e.g. llama,gpt2,bert")
    parser.add_argument("--name", help="regular expression on the architecture key or model class")
    parser.add_argument("--model", action="append", metavar="SPEC",
                        help="your own model: module:factory or file.py:factory (returning (model, inputs)), or "
                             "a module/file with a ZOO_MODELS dict; repeatable")
    parser.add_argument("--mode", choices=MODES, default="strict",
                        help="pjrt execution: strict eager, fused eager (defer_and_fuse) or torch.compile")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per model (default 300)")
    parser.add_argument("--budget-minutes", type=float, help="start no model after this many minutes")
    parser.add_argument("--limit", type=int, help="run only the first N selected models")
    parser.add_argument("--in-process", action="store_true", help="run in this process (no isolation; debugging)")
    parser.add_argument("--list", action="store_true", help="print the selected models and exit")
    parser.add_argument("--json", metavar="PATH", help="write the rows and summary as JSON")
    parser.add_argument("--report", metavar="PATH", help="write the markdown report (e.g. docs/model-coverage.md)")
    parser.add_argument("--from-json", metavar="PATH", help="run nothing: write --report from a saved --json")
    parser.add_argument("--merge", metavar="PATH",
                        help="a saved --json whose rows of the models run here this run's replace: --json and "
                             "--report then write the merged record (a re-run of a few models of a full run)")
    parser.add_argument("--log", default=os.devnull, metavar="PATH", help="workers' stderr (default: discarded)")
    parser.set_defaults(func=command)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker_main(sys.argv[2])

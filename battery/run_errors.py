"""The bad-input battery: calls that CPU rejects must be rejected on pjrt too, never answered with a value.

Usage: python -m battery.run_errors [--only KEY...] [--examples N] [--jobs 2] [--out PATH]

Two sources of bad calls, each run as keys in battery.run_opinfo's worker pool (a crash or a hang costs
one key and is recorded, not fatal):
- `errors:ENTRY`: every ErrorInput of an OpInfo entry (`op.error_inputs("cpu")`, PyTorch's own database of
  bad calls), its tensors moved to pjrt with their aliases kept (an out= that is an input stays one); and
  the ErrorInputs that the database makes only for a non-CPU device, mixing CPU and pjrt tensors, checked
  against the database's exception class since CPU alone cannot run them.
- `hypothesis:NAME`: property-based cases (battery/properties.py), `--examples` per property, derandomized
  (the same cases on every run for the same count).

Per case CPU runs first; then pjrt runs the same call on copies of its inputs and the host waits
(`torch.pjrt.synchronize()` and every output read), so a deferred device-side check is raised. The
outcome (OUTCOMES) compares the two: where CPU raises, pjrt must raise the same class, or the
RuntimeError of a deferred device check; where CPU returns, pjrt must return CPU's values.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from battery import run_opinfo

# outcome -> whether it is a defect
OUTCOMES: dict[str, bool] = {
    "returns-value-where-cpu-raises": True,
    "crash": True,
    "hang": True,
    "raises-other-class": True,
    "returns-other-value": True,
    "raises-where-cpu-returns": True,
    "unsupported": False,
    "raises-deferred-runtimeerror": False,
    "raises-same-class": False,
    "returns-cpu-value": False,
    "skip": False,
}
# (CPU's class, pjrt's class) pairs that are not defects, and why
JUSTIFIED: dict[tuple[str, str], str] = {
    ("RuntimeError", "OutOfMemoryError"): "CUDA's class for an allocation larger than the device "
                                          "(torch.OutOfMemoryError is a RuntimeError)",
}
DEFAULT_OUT = "build/bad-input/results.jsonl"
FULL_EXAMPLES = 200


class Case:
    """One bad (or borderline) call: `fn(sample.input, *sample.args, **sample.kwargs)`. `expected` is the
    database's exception class for a case CPU cannot run; `random`: compare shapes and dtypes only."""

    def __init__(self, fn: Callable[..., Any], sample: Any, what: str, expected: type[BaseException] | None = None,
                 regex: str | None = None, random: bool = False) -> None:
        self.fn, self.sample, self.what, self.expected, self.regex, self.random = (
            fn, sample, what, expected, regex, random)

    def call(self, sample: Any) -> Any:
        return self.fn(sample.input, *sample.args, **sample.kwargs)


# --- one case --------------------------------------------------------------------------------


def _text(error: BaseException | None) -> str | None:
    return None if error is None else run_opinfo._first_line(error)


def _moved(case: Case) -> tuple[Any, BaseException | None]:
    """The case's sample on pjrt (before CPU runs: an in-place call changes its inputs), or why it cannot be;
    a mixed-device case stays as the database made it: its devices are the point."""
    try:
        return (case.sample if case.expected is not None else run_opinfo.on_pjrt(case.sample, keep_aliases=True)), None
    except Exception as error:
        return None, error


def _on_pjrt(case: Case, moved: Any) -> tuple[Any, BaseException | None]:
    """pjrt's result of a case, or what it raised, the host having waited for every output."""
    from torch_pjrt.runtime import checks

    try:
        with torch.device("pjrt"):  # factory calls without a device argument
            result = case.call(moved)
        torch.pjrt.synchronize()
        pytree.tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, result)
        return result, None
    except Exception as error:
        return None, error
    finally:
        checks.clear()


def run_case(case: Case) -> dict[str, Any]:
    """The outcome of one case and both sides' first error lines."""
    from torch_pjrt.runtime import checks

    started = time.perf_counter()
    moved, pjrt_error = _moved(case)
    torch.manual_seed(0)
    cpu_error: BaseException | None = None
    if case.expected is None:
        try:
            expected = case.call(case.sample)
        except Exception as error:
            cpu_error = error
    torch.manual_seed(0)
    actual = None
    if pjrt_error is None:
        actual, pjrt_error = _on_pjrt(case, moved)
    row: dict[str, Any] = {"what": case.what, "cpu": _text(cpu_error), "pjrt": _text(pjrt_error)}
    if case.expected is not None:
        row["cpu"] = f"{case.expected.__name__} (the database's class; CPU cannot run this case)"
        cpu_class = case.expected.__name__
    else:
        cpu_class = type(cpu_error).__name__ if cpu_error is not None else None
    if case.regex is not None:  # whether each side's message is the one PyTorch's database expects
        for side, error in (("cpu", cpu_error), ("pjrt", pjrt_error)):
            if error is not None:
                row[f"{side}_as_database"] = bool(re.search(case.regex, str(error)))
    pjrt_class = type(pjrt_error).__name__ if pjrt_error is not None else None
    if cpu_class is None and pjrt_error is None:
        row["pjrt"] = _difference(actual, expected, case.random)
        row["outcome"] = "returns-other-value" if row["pjrt"] else "returns-cpu-value"
    elif cpu_class is None:
        row["outcome"] = "raises-where-cpu-returns"
    elif pjrt_error is None:
        row["outcome"] = "returns-value-where-cpu-raises"
    elif isinstance(pjrt_error, checks.DeviceCheckError):
        row["outcome"] = "raises-deferred-runtimeerror"
        row["names_cpu_class"] = f"{cpu_class} on CPU" in str(pjrt_error)
    elif pjrt_class == cpu_class:
        row["outcome"] = "raises-same-class"
    elif isinstance(pjrt_error, NotImplementedError) and "no lowering" in str(pjrt_error):
        row["outcome"] = "unsupported"
    else:
        row["outcome"] = "raises-other-class"
        if (cpu_class, pjrt_class) in JUSTIFIED:
            row["justified"] = JUSTIFIED[(cpu_class, pjrt_class)]
    if row["outcome"] in ("raises-where-cpu-returns", "raises-other-class"):
        frame = traceback.extract_tb(pjrt_error.__traceback__)[-1]
        row["raised_at"] = f"{os.path.relpath(frame.filename)}:{frame.lineno} ({frame.name})"
    row["seconds"] = round(time.perf_counter() - started, 3)
    for error in (cpu_error, pjrt_error):
        _drop_tracebacks(error)
    return row


def _drop_tracebacks(error: BaseException | None) -> None:
    """A traceback's frames keep the case's tensors (and their device memory) alive until a garbage
    collection; so do the tracebacks of the errors it was raised from."""
    while error is not None:
        error.__traceback__ = None
        error = error.__cause__ or error.__context__


def _difference(actual: Any, expected: Any, random: bool) -> str | None:
    """How pjrt's result differs from CPU's (shapes and dtypes only for a random call), or None."""
    try:
        run_opinfo.compare(actual, expected, values=not random)
    except run_opinfo.Wrong as wrong:
        return f"a different value: {wrong}"
    return None


def is_defect(row: dict[str, Any]) -> bool:
    """Whether a row's outcome is a defect (a justified other class is not)."""
    return OUTCOMES[row["outcome"]] and not row.get("justified")


# --- the cases of one key --------------------------------------------------------------------


def _devices(sample: Any) -> set[str]:
    leaves = pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
    return {v.device.type for v in leaves if isinstance(v, torch.Tensor)}


def error_cases(op: Any) -> Iterator[Case]:
    """An entry's ErrorInputs for CPU, then those it makes only for another device that mix devices."""
    for index, error_input in enumerate(op.error_inputs("cpu")):
        yield Case(op, error_input.sample_input, f"error_inputs[{index}]: {error_input.sample_input.summary()}",
                   regex=error_input.error_regex)
    if not _names_cpu(op.error_inputs_func):
        return
    with contextlib.suppress(Exception):  # a database function that cannot build pjrt tensors: CPU's cases only
        for index, error_input in enumerate(op.error_inputs("pjrt")):
            sample = error_input.sample_input
            if len(_devices(sample)) > 1:
                yield Case(op, sample, f"error_inputs('pjrt')[{index}], devices mixed: "
                           f"{sample.summary()}", expected=error_input.error_type, regex=error_input.error_regex)


def _names_cpu(function: Any) -> bool:
    """Whether a database function names the CPU device in its source: only those make cases that mix devices
    (building every entry's cases on pjrt costs minutes of compiles for nothing)."""
    function = getattr(function, "func", function)  # a functools.partial
    try:
        return "cpu" in inspect.getsource(function)
    except (OSError, TypeError):
        return False


def keys(entries: dict[str, Any]) -> list[str]:
    """Every key of the battery: OpInfo entries with error inputs, then the properties."""
    from battery import properties

    found = [f"errors:{k}" for k, op in sorted(entries.items()) if op.error_inputs_func is not None]
    return found + [f"hypothesis:{name}" for name in properties.PROPERTIES]


def run_key(key: str, entries: dict[str, Any], examples: int, emit: Callable[[dict[str, Any]], None],
            tick: Callable[[str], None] = lambda at: None) -> None:
    """Run every case of one key, emitting a row for each (`tick` first, naming the case)."""
    source, name = key.split(":", 1)
    count = 0

    def one(case: Case) -> None:
        nonlocal count
        tick(case.what)
        emit({"key": key, "case": count, **run_case(case)})
        count += 1

    if source == "hypothesis":
        from battery import properties

        properties.explore(name, examples, one)
        return
    for case in error_cases(entries[name]):
        one(case)
    if count == 0:
        emit({"key": key, "case": 0, "what": "", "outcome": "skip", "cpu": None, "pjrt": None,
              "detail": "PyTorch's database makes error inputs for this entry only for other devices "
                        "(none for CPU, none mixing devices for pjrt)"})


# --- the worker and the command line ---------------------------------------------------------


def worker_main(examples: int) -> None:
    """Read keys on stdin, write JSON rows on the original stdout (as run_opinfo.worker_main does)."""
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    torch.set_num_threads(1)
    import torch_pjrt  # noqa: F401  (registers the device even when autoload is off)

    entries = run_opinfo.load_entries()
    emit = lambda row: results.write(json.dumps(row) + "\n")
    emit({"event": "ready"})
    for line in sys.stdin:
        key = line.strip()
        try:
            run_key(key, entries, examples, emit, lambda at: emit({"event": "tick", "at": at[:200]}))
        except Exception:
            traceback.print_exc()
            emit({"key": key, "case": -1, "what": "the battery itself", "outcome": "crash", "cpu": None,
                  "pjrt": traceback.format_exc().strip().splitlines()[-1][:280]})
        emit({"key": key, "event": "done"})


def _select(all_keys: list[str], only: list[str] | None) -> list[str]:
    """Keys matching --only: exact keys, else substrings."""
    if not only:
        return all_keys
    chosen = [k for name in only for k in ([name] if name in all_keys else [k for k in all_keys if name in k])]
    if not chosen:
        raise SystemExit(f"no key matches {only!r}; keys are errors:ENTRY and hypothesis:PROPERTY")
    return list(dict.fromkeys(chosen))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m battery.run_errors", description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", help="keys (errors:ENTRY, hypothesis:PROPERTY) or substrings")
    parser.add_argument("--examples", type=int, default=FULL_EXAMPLES, help="hypothesis cases per property")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default=DEFAULT_OUT, help="JSON lines of results")
    parser.add_argument("--report", action=argparse.BooleanOptionalAction, default=None,
                        help="write docs/bad-input.md from --out (default: on full runs)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args.examples)
        return
    chosen = _select(keys(run_opinfo.load_entries()), args.only)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    started = time.time()
    with open(args.out, "w") as out:
        def sink(row: dict[str, Any]) -> None:
            if row.get("status") == "crash":  # the pool's row for a worker that died or hung
                hung = row["detail"].startswith("timeout")
                row = {"key": row["key"], "case": -1, "what": row["detail"], "outcome": "hang" if hung else "crash",
                       "cpu": None, "pjrt": None}
            out.write(json.dumps(row) + "\n")
            out.flush()
            if is_defect(row):
                print(f"    {row['key']} [{row['case']}] {row['outcome']}: {row['what'][:120]}", file=sys.stderr)

        command = ["-m", "battery.run_errors", "--worker", "--examples", str(args.examples)]
        run_opinfo.Pool(args.jobs, command, args.out + ".log", sink).run(chosen)
    meta = {"torch": torch.__version__, "keys": len(chosen), "all_keys": not args.only,
            "examples": args.examples, "jobs": args.jobs, "seconds": round(time.time() - started, 1),
            "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with open(args.out + ".meta.json", "w") as f:
        json.dump(meta, f, indent=1)
    print(f"{len(chosen)} keys in {meta['seconds']:.0f} s -> {args.out}", file=sys.stderr)
    if args.report or (args.report is None and not args.only):
        from battery import errors_report

        errors_report.main([args.out])


if __name__ == "__main__":
    main()

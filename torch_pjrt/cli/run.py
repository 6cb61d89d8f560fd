"""`torch-pjrt run SCRIPT [ARGS...]`: run an unmodified CUDA script on pjrt and report what happened.

The script runs in this process as `python SCRIPT ARGS` would run it (`__main__`, `sys.argv`,
its folder first on `sys.path`), inside the CUDA shim. At exit a report lists the ops executed,
compiles, transfers, the ops that fell back to CPU and the ops with no pjrt lowering, each with
the line of the user's code that reached it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import linecache
import os
import re
import runpy
import sys
import time
import traceback
import types
from collections import Counter
from collections.abc import Iterator
from typing import Any

MISSING_LOWERING = re.compile(r"has no lowering for (\S+) on pjrt")
EXIT_USAGE = 2


def shown_path(path: str) -> str:
    """A path relative to the working folder when it lies below it, else absolute."""
    relative = os.path.relpath(path)
    return os.path.abspath(path) if relative.startswith("..") else relative


@dataclasses.dataclass
class OpSite:
    """An op reached from a line of user code."""

    op: str
    file: str | None
    line: int | None

    def describe(self) -> str:
        if self.file is None:
            return self.op
        code = linecache.getline(self.file, self.line or 0).strip()
        return f"{self.op} at {shown_path(self.file)}:{self.line}" + (f": {code}" if code else "")


class UserCode:
    """Tells the user's own files (the script's folder, outside installed packages) from library code."""

    def __init__(self, script: str) -> None:
        self.script = os.path.abspath(script)
        self.folder = os.path.dirname(self.script)
        self.library = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def owns(self, filename: str) -> bool:
        path = os.path.abspath(filename)
        if path == self.script:
            return True
        inside = path.startswith(self.folder + os.sep) and not path.startswith(self.library + os.sep)
        return inside and "site-packages" not in path

    def innermost(self, frames: list[tuple[str, int]]) -> tuple[str | None, int | None]:
        """The innermost (file, line) of user code among frames listed outermost first."""
        for filename, line in reversed(frames):
            if self.owns(filename):
                return filename, line
        return None, None

    def stack_site(self) -> tuple[str | None, int | None]:
        """The innermost user line on the current call stack."""
        frame = sys._getframe(1)
        while frame is not None:
            if self.owns(frame.f_code.co_filename):
                return frame.f_code.co_filename, frame.f_lineno
            frame = frame.f_back
        return None, None

    def traceback_site(self, tb: types.TracebackType | None) -> tuple[str | None, int | None]:
        return self.innermost([(frame.f_code.co_filename, line) for frame, line in traceback.walk_tb(tb)])


class Recorder:
    """Wraps torch_pjrt's fallback hooks to learn which op each CPU fallback and missing lowering was."""

    def __init__(self, user: UserCode) -> None:
        self.user = user
        self.fallbacks: dict[str, OpSite] = {}
        self.unsupported: dict[str, OpSite] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[Recorder]:
        from torch_pjrt.eager import fallback

        run_on_cpu, missing_message = fallback.run_on_cpu, fallback.missing_message

        def recording_run_on_cpu(op: Any, args: tuple, kwargs: dict) -> Any:
            if str(op) not in self.fallbacks:
                self.fallbacks[str(op)] = OpSite(str(op), *self.user.stack_site())
            return run_on_cpu(op, args, kwargs)

        def recording_missing_message(op: Any, compiled: bool = False) -> str:
            message = missing_message(op, compiled)
            name = MISSING_LOWERING.search(message)
            key = name.group(1) if name else str(op)
            if key not in self.unsupported:
                self.unsupported[key] = OpSite(key, *self.user.stack_site())
            return message

        fallback.run_on_cpu, fallback.missing_message = recording_run_on_cpu, recording_missing_message
        try:
            yield self
        finally:
            fallback.run_on_cpu, fallback.missing_message = run_on_cpu, missing_message

    def note_error(self, error: BaseException) -> None:
        """A NotImplementedError the script did not catch: keep its op and the user line that raised it."""
        name = MISSING_LOWERING.search(str(error))
        key = name.group(1) if name else str(error).splitlines()[0] if str(error) else type(error).__name__
        if key not in self.unsupported or self.unsupported[key].file is None:
            self.unsupported[key] = OpSite(key, *self.user.traceback_site(error.__traceback__))


def run_path(script: str, argv: list[str]) -> None:
    """Run a script as `python script argv...` would, in this process."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def exit_status(code: Any) -> int:
    """What the interpreter exits with for SystemExit(code)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def print_script_error(error: BaseException, user: UserCode) -> None:
    """The traceback as `python SCRIPT` would print it: from the script's first frame, without the CLI's."""
    tb = error.__traceback__
    while tb is not None and not user.owns(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    report = traceback.TracebackException(type(error), error, tb or error.__traceback__)
    cli = os.path.dirname(os.path.abspath(__file__)) + os.sep
    report.stack = traceback.StackSummary.from_list([f for f in report.stack if not f.filename.startswith(cli)])
    print("".join(report.format()), end="", file=sys.stderr)


def format_bytes(count: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} GB"


def report(script: str, status: int, seconds: float, recorder: Recorder, cpu_fallback: bool) -> str:
    from torch_pjrt import _registration
    from torch_pjrt.eager import modes
    from torch_pjrt.runtime import metrics

    counts = metrics.counters()
    top = ", ".join(f"{op} {n}" for op, n in metrics.op_counts.most_common(5))
    lines = [f"== torch-pjrt run report: {script} ==",
             f"exit status      {status}",
             f"wall time        {seconds:.2f} s",
             f"eager mode       {modes.current().value}"]
    if _registration.initialized():
        from torch_pjrt.runtime import client

        lines.append(f"platform         {client.platform()} ({len(client.devices())} device(s))")
    lines += [f"ops executed     {counts['ops_executed']}" + (f" (most: {top})" if top else ""),
              f"compiles         {counts['compiles']} in {counts['compile_seconds']:.2f} s "
              f"(cache hits {counts['cache_hits']}, misses {counts['cache_misses']})",
              f"transfers        host->device {counts['transfers_to_device']} "
              f"({format_bytes(counts['bytes_to_device'])}), device->host {counts['transfers_to_host']} "
              f"({format_bytes(counts['bytes_to_host'])})"]
    fallen = Counter(metrics.fallback_ops)
    if fallen:
        lines.append(f"CPU fallbacks    {counts['cpu_fallbacks']} call(s) of {len(fallen)} op(s):")
        for op, calls in fallen.most_common():
            site = recorder.fallbacks.get(op, OpSite(op, None, None))
            lines.append(f"  {site.describe()} ({calls} call(s))")
    else:
        lines.append("CPU fallbacks    none" + ("" if cpu_fallback else " (enable with --cpu-fallback)"))
    if recorder.unsupported:
        lines.append(f"unsupported ops  {len(recorder.unsupported)}:")
        lines += [f"  {site.describe()}" for site in recorder.unsupported.values()]
        if not cpu_fallback:
            lines.append("  rerun with --cpu-fallback to run them on CPU, and please report them")
    else:
        lines.append("unsupported ops  none")
    return "\n".join(lines)


def compile_backend_ready() -> bool:
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.exc import InvalidBackend

    try:
        lookup_backend("pjrt")
    except InvalidBackend:
        return False
    return True


@contextlib.contextmanager
def compile_to_pjrt() -> Iterator[None]:
    """torch.compile calls in the script use the pjrt backend (inductor cannot target pjrt)."""
    import torch

    original = torch.compile

    def pjrt_compile(model: Any = None, *args: Any, backend: Any = "inductor", **kwargs: Any) -> Any:
        return original(model, *args, backend="pjrt" if backend == "inductor" else backend, **kwargs)

    torch.compile = pjrt_compile
    os.environ["TORCH_PJRT_COMPILE"] = "1"
    try:
        yield
    finally:
        torch.compile = original
        os.environ.pop("TORCH_PJRT_COMPILE", None)


def prepare(args: argparse.Namespace) -> str | None:
    """Check the script and flags before running; an error message, or None."""
    if not os.path.isfile(args.script):
        return f"{args.script}: no such file"
    if args.eager_mode:
        import torch_pjrt

        try:
            with torch_pjrt.set_eager_mode(args.eager_mode):
                pass
        except NotImplementedError as error:
            return f"--eager-mode {args.eager_mode}: {error}"
    if args.compile and not compile_backend_ready():
        return ("--compile: the torch.compile backend \"pjrt\" is not registered in this build of torch_pjrt "
                "yet; run without --compile (eager)")
    return None


def command(args: argparse.Namespace) -> int:
    problem = prepare(args)
    if problem:
        print(f"torch-pjrt run: {problem}", file=sys.stderr)
        return EXIT_USAGE
    import torch_pjrt
    from torch_pjrt.cli.cuda_shim import CudaShim

    torch_pjrt.metrics.reset()
    user = UserCode(args.script)
    recorder = Recorder(user)
    status = 0
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(recorder.installed())
        if args.eager_mode:
            stack.enter_context(torch_pjrt.set_eager_mode(args.eager_mode))
        if args.cpu_fallback:
            stack.enter_context(torch_pjrt.cpu_fallback())
        if args.compile:
            stack.enter_context(compile_to_pjrt())
        stack.enter_context(CudaShim("pjrt"))
        try:
            run_path(args.script, args.args)
        except SystemExit as exit_:
            status = exit_status(exit_.code)
        except Exception as error:  # noqa: BLE001 (the user's script failed: report it, as python would)
            print_script_error(error, user)
            if isinstance(error, NotImplementedError):
                recorder.note_error(error)
            print(f"torch-pjrt run: {args.script} raised {type(error).__name__}", file=sys.stderr)
            status = 1
        summary = report(args.script, status, time.perf_counter() - start, recorder, args.cpu_fallback)
    print(summary, file=sys.stderr)
    return status


def add_parser(subparsers: Any) -> None:
    from torch_pjrt.eager.modes import EagerMode

    parser = subparsers.add_parser(
        "run", help="run an unmodified CUDA script on pjrt and report ops, fallbacks and compiles",
        description="Run SCRIPT as `python SCRIPT ARGS` would, with CUDA mapped to the pjrt device.")
    parser.add_argument("--eager-mode", choices=[mode.value for mode in EagerMode],
                        help="how ops execute (default: TORCH_PJRT_EAGER_MODE or defer_never)")
    parser.add_argument("--cpu-fallback", action="store_true", help="run ops with no pjrt lowering on CPU")
    parser.add_argument("--compile", action="store_true",
                        help="route the script's torch.compile calls to the pjrt backend")
    parser.add_argument("script", metavar="SCRIPT")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed to the script")
    parser.set_defaults(func=command)

"""`torch-pjrt bench`: measure a training workload on pjrt against CPU before migrating.

Presets train examples/gpt.py's GPT (tokens) or a small ResNet defined here (samples); `--script`
runs a CUDA script through the same shim as `run` and times it step by step (one step per
`optimizer.step()`). Per device: time to first step (compiles included), steady step time (median,
p10, p90), throughput, peak memory, compile seconds, and cost with `--price-per-hour`. `--profile PATH`
runs PyTorch's profiler over pjrt's steps after the warmup and writes its Chrome trace (docs/profiler.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import resource
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import torch
from torch import nn
from torch.nn import functional

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
SIZES = {
    "gpt": {"tiny": {"width": 32, "layers": 1, "heads": 2, "context": 16, "batch": 2},
            "small": {"width": 128, "layers": 2, "heads": 4, "context": 64, "batch": 8}},
    "resnet": {"tiny": {"width": 8, "blocks": 1, "image": 16, "batch": 4},
               "small": {"width": 32, "blocks": 2, "image": 32, "batch": 16}},
}
COST_UNITS = {"tokens": ("1M tokens", 1e6), "samples": ("1k samples", 1e3), "steps": ("1k steps", 1e3)}


class BenchError(Exception):
    """A problem with the bench's inputs, reported as one clear line."""


# --- workloads ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Workload:
    """A training step on one device: a fresh model, its optimizer, batches and a step that returns the loss."""

    name: str
    unit: str
    items_per_step: int
    build: Callable[[], nn.Module]
    optimizer: Callable[[Any], torch.optim.Optimizer]
    batches: Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]]
    step: Callable[[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor], torch.Tensor]


def load_gpt() -> Any:
    """examples/gpt.py of the source tree, imported by path (it is not part of the installed package)."""
    path = os.path.join(EXAMPLES, "gpt.py")
    if not os.path.isfile(path):
        raise BenchError(f"preset gpt needs examples/gpt.py from a torch-pjrt source checkout (not found at {path}); "
                         "run from a checkout or use --script")
    spec = importlib.util.spec_from_file_location("torch_pjrt_examples_gpt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpt_workload(size: dict[str, int]) -> Workload:
    gpt = load_gpt()
    corpus = gpt.corpus_bytes()
    return Workload(
        "gpt", "tokens", size["batch"] * size["context"],
        lambda: gpt.GPT(width=size["width"], layers=size["layers"], heads=size["heads"], context=size["context"]),
        lambda parameters: torch.optim.AdamW(parameters, lr=3e-3, weight_decay=0.01),
        lambda steps: gpt.batches(corpus, size["batch"], size["context"], steps),
        gpt.train_step,
    )


class BasicBlock(nn.Module):
    """ResNet's two 3x3 convolutions with batch norm and a (projected when needed) shortcut."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.norm1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(outputs)
        self.shortcut = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = functional.relu(self.norm1(self.conv1(x)))
        return functional.relu(self.norm2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    """A small ResNet (no torchvision): a stem and three stages that halve the image and double the width."""

    def __init__(self, width: int = 16, blocks: int = 1, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        stages, channels = [], width
        for stage in range(3):
            outputs = width * 2**stage
            for block in range(blocks):
                stages.append(BasicBlock(channels, outputs, 2 if stage and not block else 1))
                channels = outputs
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)).mean(dim=(2, 3)))


def classifier_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
                    targets: torch.Tensor) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = functional.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss.detach()


def resnet_workload(size: dict[str, int]) -> Workload:
    def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(0)
        shape = (size["batch"], 3, size["image"], size["image"])
        return [(torch.randn(shape, generator=generator), torch.randint(0, 10, (size["batch"],), generator=generator))
                for _ in range(steps)]

    return Workload(
        "resnet", "samples", size["batch"],
        lambda: ResNet(size["width"], size["blocks"]),
        lambda parameters: torch.optim.SGD(parameters, lr=0.05, momentum=0.9),
        batches,
        classifier_step,
    )


PRESETS = {"gpt": gpt_workload, "resnet": resnet_workload}


# --- measuring ------------------------------------------------------------------------------------


class Progress:
    """A one-line progress bar on a terminal (tqdm is not a dependency)."""

    def __init__(self, total: int | None, label: str, stream: TextIO = sys.stderr, enabled: bool | None = None,
                 width: int = 24) -> None:
        self.total, self.label, self.stream, self.width = total, label, stream, width
        self.enabled = stream.isatty() if enabled is None else enabled
        self.done = 0

    def update(self, seconds: float) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.total:
            filled = round(self.width * self.done / self.total)
            bar = f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total}"
        else:
            bar = f"step {self.done}"
        self.stream.write(f"\r{self.label:<6} {bar} {seconds * 1e3:8.1f} ms/step")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.done:
            self.stream.write("\n")
            self.stream.flush()


def percentile(values: list[float], fraction: float) -> float:
    """Linear interpolation between the closest ranks."""
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def synchronize(device: str) -> None:
    if device == "pjrt":
        torch.pjrt.synchronize()
    elif device == "cuda":
        torch.cuda.synchronize()


class MemoryProbe:
    """Peak memory of a run: the device's allocation peak, or on CPU the growth of the process's max RSS."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.kind = {"pjrt": "device peak allocated", "cuda": "device peak allocated"}.get(
            device, "process max-RSS growth")
        if device == "pjrt":
            torch.pjrt.reset_peak_memory_stats()
        elif device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self.rss_before = self.max_rss()

    @staticmethod
    def max_rss() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB

    def peak(self) -> int:
        if self.device == "pjrt":
            return torch.pjrt.max_memory_allocated()
        if self.device == "cuda":
            return torch.cuda.max_memory_allocated()
        return self.max_rss() - self.rss_before


@dataclasses.dataclass
class Run:
    """What one device did: step end times since start, losses, memory and compiles."""

    device: str
    first_step_s: float = 0.0
    step_times: list[float] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)
    peak_memory: int = 0
    memory_kind: str = ""
    compiles: int | None = None
    compile_seconds: float | None = None
    profile: dict[str, Any] | None = None


class ProfileWindow(contextlib.AbstractContextManager):
    """PyTorch's profiler (CPU and the pjrt device) from the start of step `first` of a pjrt run to its
    end; `finish` writes the Chrome trace to `path`. Inactive without a path or on other devices; a run
    that fails leaves the `with` block with the profiler stopped and nothing written."""

    def __init__(self, path: str | None, device: str, first: int) -> None:
        self.path = path if device == "pjrt" else None
        self.first = first
        self.profile: Any = None

    def at_step(self, index: int) -> None:
        """Called as step `index` begins."""
        if self.path is not None and index == self.first and self.profile is None:
            from torch.profiler import ProfilerActivity, profile

            self.profile = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1])
            self.profile.start()

    def finish(self, run: Run, steps: int) -> None:
        """After `steps` steps: stop, write the trace, print the ops with the most device time to stderr,
        and note the trace in `run`."""
        if self.path is None:
            return
        if self.profile is None:
            raise BenchError(f"--profile: pjrt ran {steps} step(s), none after the {self.first} warmup step(s); "
                             "lower --warmup or run more steps")
        self.profile.stop()
        self.profile.export_chrome_trace(self.path)
        averages = self.profile.key_averages()
        self.profile = None
        print(averages.table(sort_by="device_time_total", row_limit=12), file=sys.stderr)
        print(f"pjrt profile of steps {self.first}..{steps - 1} written to {self.path} (step times from step "
              f"{self.first} on include the profiler's wait after every program)", file=sys.stderr)
        run.profile = {"trace": self.path, "first_step": self.first, "steps": steps - self.first,
                       "device_seconds": sum(row.self_device_time_total for row in averages) / 1e6}

    def __exit__(self, *exc: object) -> None:
        if self.profile is not None:
            self.profile.stop()
            self.profile = None


@contextlib.contextmanager
def measured(device: str) -> Iterator[Run]:
    """Memory and compile counters around a run on `device`."""
    from torch_pjrt.runtime import metrics

    run = Run(device)
    probe = MemoryProbe(device)
    before = metrics.counters()
    yield run
    synchronize(device)
    run.peak_memory, run.memory_kind = probe.peak(), probe.kind
    if device == "pjrt":
        after = metrics.counters()
        run.compiles = int(after["compiles"] - before["compiles"])
        run.compile_seconds = after["compile_seconds"] - before["compile_seconds"]


def run_workload(workload: Workload, device: str, steps: int, progress: Progress,
                 window: ProfileWindow | None = None) -> Run:
    torch.manual_seed(0)
    data = workload.batches(steps)
    window = window or ProfileWindow(None, device, 0)
    with measured(device) as run, window:
        start = time.perf_counter()
        model = workload.build().to(device)
        optimizer = workload.optimizer(model.parameters())
        for index, (inputs, targets) in enumerate(data):
            window.at_step(index)
            began = time.perf_counter()
            run.losses.append(workload.step(model, optimizer, inputs.to(device), targets.to(device)).item())
            ended = time.perf_counter()
            if index == 0:
                run.first_step_s = ended - start
            else:
                run.step_times.append(ended - began)
            progress.update(ended - began)
        window.finish(run, steps)
    return run


def run_script(script: str, argv: list[str], device: str, progress: Progress,
               window: ProfileWindow | None = None) -> Run:
    """A CUDA script on `device` through the run shim; a step ends at each optimizer.step().

    The script's own output goes to stderr: stdout carries the bench's table or JSON."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from torch_pjrt.cli.cuda_shim import CudaShim
    from torch_pjrt.cli.run import UserCode, print_script_error, run_path

    last_loss: list[torch.Tensor] = []
    marks: list[float] = []
    window = window or ProfileWindow(None, device, 0)

    def on_step(*_: Any) -> None:
        synchronize(device)
        marks.append(time.perf_counter())
        if last_loss and last_loss[-1].numel() == 1:
            run.losses.append(float(last_loss[-1].detach().float().cpu()))
        progress.update(marks[-1] - (marks[-2] if len(marks) > 1 else start))
        window.at_step(len(marks))  # the next step begins

    def on_backward(loss: torch.Tensor) -> None:
        last_loss[:] = [loss]

    if device == "cpu":
        torch.pjrt.init()  # the shim maps torch.cuda.* to torch.pjrt: start jax outside the CPU timing
    torch.manual_seed(0)
    with measured(device) as run, window:
        handle = register_optimizer_step_post_hook(on_step)
        window.at_step(0)
        start = time.perf_counter()
        try:
            with CudaShim(device, on_backward=on_backward), contextlib.redirect_stdout(sys.stderr):
                run_path(script, argv)
        except SystemExit as exit_:
            if exit_.code not in (None, 0):
                raise BenchError(f"{script} exited with status {exit_.code} on {device}") from None
        except Exception as error:  # noqa: BLE001 (the user's script failed: show where, then stop)
            print_script_error(error, UserCode(script))
            raise BenchError(f"{script} raised {type(error).__name__} on {device}") from None
        finally:
            handle.remove()
        window.finish(run, len(marks))
    if not marks:
        raise BenchError(f"{script} ran on {device} but never called optimizer.step(): no steps to time")
    run.first_step_s = marks[0] - start
    run.step_times = [b - a for a, b in zip(marks, marks[1:])]
    return run


# --- results --------------------------------------------------------------------------------------


def summarise(run: Run, unit: str, items_per_step: int, prices: dict[str, float], warmup: int) -> dict[str, Any]:
    """Steady statistics leave out the first `warmup` steps (the first step and compiles of later new
    programs, e.g. optimizer state created on step one), keeping at least one step."""
    steady = run.step_times[max(warmup - 1, 0):] or run.step_times[-1:] or [run.first_step_s]
    median = statistics.median(steady)
    throughput = items_per_step / median if median > 0 else None
    result: dict[str, Any] = {
        "device": run.device,
        "steps": len(run.step_times) + 1,
        "time_to_first_step_s": run.first_step_s,
        "steady_steps": len(steady),
        "step_time_s": {"median": median, "p10": percentile(steady, 0.1), "p90": percentile(steady, 0.9),
                        "mean": statistics.fmean(steady)},
        "throughput": throughput,
        "throughput_unit": f"{unit}/s",
        "peak_memory_bytes": run.peak_memory,
        "peak_memory_kind": run.memory_kind,
        "compiles": run.compiles,
        "compile_seconds": run.compile_seconds,
        "final_loss": run.losses[-1] if run.losses else None,
        "losses": run.losses,
        "step_times_s": run.step_times,
    }
    if run.profile is not None:
        result["profile"] = run.profile
    if run.device in prices and throughput:
        label, scale = COST_UNITS[unit]
        result["cost"] = {"usd": prices[run.device] / 3600 / throughput * scale, "per": label,
                          "price_per_hour_usd": prices[run.device]}
    return result


def format_table(report: dict[str, Any]) -> str:
    from torch_pjrt.cli.run import format_bytes

    header = ["device", "first step", "step median", "p10..p90", "throughput", "peak memory", "compiles", "loss"]
    costs = any("cost" in r for r in report["results"])
    if costs:
        header.append("cost")
    rows = [header]
    for r in report["results"]:
        step = r["step_time_s"]
        row = [r["device"], f"{r['time_to_first_step_s']:.2f} s", f"{step['median'] * 1e3:.1f} ms",
               f"{step['p10'] * 1e3:.1f}..{step['p90'] * 1e3:.1f} ms",
               f"{r['throughput']:.1f} {r['throughput_unit']}" if r["throughput"] else "-",
               f"{format_bytes(max(r['peak_memory_bytes'], 0))} ({r['peak_memory_kind']})",
               "-" if r["compiles"] is None else f"{r['compiles']} in {r['compile_seconds']:.1f} s",
               "-" if r["final_loss"] is None else f"{r['final_loss']:.4f}"]
        if costs:
            row.append(f"${r['cost']['usd']:.4g} per {r['cost']['per']}" if "cost" in r else "-")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [f"bench {report['workload']}: {report['items_per_step']} {report['unit']} per step"]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (times, losses) = plt.subplots(1, 2, figsize=(10, 4))
    for r in report["results"]:
        times.plot(range(2, len(r["step_times_s"]) + 2), [t * 1e3 for t in r["step_times_s"]], label=r["device"])
        losses.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["device"])
    times.set(xlabel="step", ylabel="step time (ms)", title="steady step time")
    losses.set(xlabel="step", ylabel="loss", title="training loss")
    times.legend()
    losses.legend()
    figure.tight_layout()
    figure.savefig(path)


def parse_prices(values: list[str]) -> dict[str, float]:
    prices = {}
    for value in values:
        device, _, price = value.partition("=")
        try:
            prices[device.strip()] = float(price)
        except ValueError:
            raise BenchError(f"--price-per-hour {value!r}: expected DEVICE=USD, e.g. pjrt=2.40") from None
    return prices


def parse_devices(value: str | None) -> list[str]:
    if value is None:
        return ["cpu", "pjrt"] + (["cuda"] if torch.cuda.is_available() else [])
    devices = [d.strip() for d in value.split(",") if d.strip()]
    unknown = [d for d in devices if d not in ("cpu", "pjrt", "cuda")]
    if unknown or not devices:
        raise BenchError(f"--devices {value!r}: use a comma-separated list of cpu, pjrt, cuda")
    return devices


def bench(args: argparse.Namespace) -> dict[str, Any]:
    devices = parse_devices(args.devices)
    prices = parse_prices(args.price_per_hour)
    if args.steps < 1:
        raise BenchError(f"--steps {args.steps}: at least one step is needed")
    if args.profile and "pjrt" not in devices:
        raise BenchError(f"--profile {args.profile}: it profiles the pjrt run; add pjrt to --devices")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise BenchError(f"--plot {args.plot}: matplotlib is not installed (pip install matplotlib)")
    if args.script:
        if not os.path.isfile(args.script):
            raise BenchError(f"--script {args.script}: no such file")
        if "cuda" in devices:
            raise BenchError("--script runs through the CUDA shim: use --devices cpu,pjrt")
        unit, items, name = ("samples", args.items_per_step, args.script) if args.items_per_step else ("steps", 1,
                                                                                                      args.script)
    else:
        workload = PRESETS[args.preset](SIZES[args.preset][args.size])
        unit, items, name = workload.unit, workload.items_per_step, f"{args.preset} ({args.size})"
    results = []
    for device in devices:
        progress = Progress(None if args.script else args.steps, device, enabled=args.progress)
        try:
            window = ProfileWindow(args.profile, device, min(args.warmup, args.steps - 1) if not args.script
                                   else args.warmup)
            if args.script:
                run = run_script(args.script, shlex.split(args.script_args), device, progress, window)
            else:
                run = run_workload(workload, device, args.steps, progress, window)
        finally:
            progress.close()
        results.append(summarise(run, unit, items, prices, args.warmup))
    return {"workload": name, "unit": unit, "items_per_step": items, "results": results}


def command(args: argparse.Namespace) -> int:
    try:
        report = bench(args)
    except BenchError as error:
        print(f"torch-pjrt bench: {error}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    if args.plot:
        plot(report, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench", help="measure a training workload on pjrt against CPU",
        description="Time to first step, steady step time, throughput, peak memory, compiles and cost per device.")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=sorted(PRESETS), default="gpt")
    source.add_argument("--script", help="a CUDA training script, run through the same shim as `run`")
    parser.add_argument("--script-args", default="", help="arguments for --script, as one shell-quoted string")
    parser.add_argument("--items-per-step", type=int,
                        help="samples per optimizer step of --script (throughput then reads samples/s)")
    parser.add_argument("--size", choices=("tiny", "small"), default="small", help="preset model and batch size")
    parser.add_argument("--steps", type=int, default=20, help="training steps per device (presets)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="steps left out of the steady step time, the first included (default 2)")
    parser.add_argument("--devices", help="comma-separated: cpu, pjrt, cuda (default: cpu,pjrt and cuda if present)")
    parser.add_argument("--price-per-hour", action="append", default=[], metavar="DEVICE=USD",
                        help="hourly price of a device: adds cost per 1M tokens (or per 1k samples)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="draw step time and loss per step (needs matplotlib)")
    parser.add_argument("--profile", metavar="TRACE.json",
                        help="profile pjrt's steps after the warmup with torch.profiler (CPU and device) and write "
                             "the Chrome trace (.json or .json.gz); pjrt's step times then include its waits")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar on stderr (default: when stderr is a terminal)")
    parser.set_defaults(func=command)

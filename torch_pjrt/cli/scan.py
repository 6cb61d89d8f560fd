"""`torch-pjrt scan`: a parsed (not grepped) inventory of CUDA dependence, with optional rewrites.

Python files go through libcst: import aliases are resolved to qualified names, so
`from torch.cuda import amp; amp.autocast()` is found as `torch.cuda.amp.autocast`, and the
rewrites keep formatting and comments. `.cu`/`.cuh` files are reported as blockers.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import MetadataWrapper, ParentNodeProvider, PositionProvider, QualifiedNameProvider

SEVERITIES = {
    "portable": "portable as is",
    "mechanical": "mechanical rewrite",
    "needs-work": "needs work",
    "blocker": "blocker",
}

CUDA_SOURCE_SUFFIXES = (".cu", ".cuh")
SKIPPED_FOLDERS = {"__pycache__", "node_modules", "site-packages"}
DEVICE_STRING = re.compile(r"cuda(:\d+)?")

# torch.cuda.X -> torch.accelerator.Y, where Y works for the pjrt device.
ACCELERATOR = {
    "is_available": "is_available",
    "device_count": "device_count",
    "current_device": "current_device_index",
    "set_device": "set_device_index",
}
# torch.cuda.X that torch.pjrt mirrors under the same name (synchronize is here: on torch 2.13
# torch.accelerator.synchronize() fails for a Python backend).
PJRT_MIRRORS = frozenset(
    "synchronize manual_seed manual_seed_all seed seed_all initial_seed get_rng_state set_rng_state "
    "get_rng_state_all set_rng_state_all get_device_name get_device_properties get_device_capability "
    "memory_allocated max_memory_allocated memory_reserved max_memory_reserved memory_stats "
    "reset_peak_memory_stats reset_max_memory_allocated empty_cache mem_get_info is_bf16_supported "
    "is_initialized init device".split()
)
STREAMS_EVENTS = frozenset("Stream Event current_stream default_stream stream set_stream".split())
GRAPHS = frozenset(
    "graph graphs CUDAGraph make_graphed_callables graph_pool_handle is_current_stream_capturing".split()
)
LEGACY_TENSOR_TYPES = re.compile(r"(BFloat16|Bool|Byte|Char|Double|Float|Half|Int|Long|Short)Tensor")
BLOCKER_IMPORTS = {"triton": "triton", "cupy": "cupy-pycuda", "cupyx": "cupy-pycuda", "pycuda": "cupy-pycuda"}
# Every rule needs one of these in the source (lower-cased): files without them skip the CST pass.
KEYWORDS = ("cuda", "nccl", "triton", "cupy", "cpp_extension")
KERNEL_HINT = ("rewrite it as a JAX or Pallas function and wrap it with torch_pjrt.kernels.jax_op, which makes it a "
               "PyTorch op on pjrt (docs/kernels.md)")


@dataclasses.dataclass(frozen=True)
class Finding:
    file: str
    line: int
    category: str
    severity: str
    suggestion: str
    code: str = ""
    fixable: bool = False

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Rule:
    """What a qualified name means: its finding, and the dotted name that replaces it (if mechanical)."""

    category: str
    severity: str
    suggestion: str
    replacement: str | None = None


def torch_cuda_rule(member: str, rest: str) -> Rule:
    """The rule for `torch.cuda.<member>[.<rest>]`."""
    if member == "amp":
        return amp_rule(rest)
    if member in GRAPHS:
        return Rule("cuda-graphs", "needs-work",
                    "no CUDA graphs on pjrt: compile the captured region with torch.compile(backend=\"pjrt\") or "
                    "run it in the DEFER_AND_FUSE eager mode, which replays one compiled program")
    if member in STREAMS_EVENTS and not rest:
        return Rule("streams-events", "mechanical",
                    f"torch.pjrt.{member} (one queue per device: ordering is kept, streams do not overlap)",
                    f"torch.pjrt.{member}")
    if member == "nccl":
        return nccl_rule()
    if member in ACCELERATOR and not rest:
        target = f"torch.accelerator.{ACCELERATOR[member]}"
        return Rule("torch-cuda", "mechanical", target, target)
    if member in PJRT_MIRRORS and not rest:
        return Rule("torch-cuda", "mechanical", f"torch.pjrt.{member}", f"torch.pjrt.{member}")
    if member == "OutOfMemoryError":
        return Rule("torch-cuda", "mechanical", "torch.OutOfMemoryError", "torch.OutOfMemoryError")
    if LEGACY_TENSOR_TYPES.fullmatch(member):
        return Rule("torch-cuda", "needs-work", "torch.tensor(..., dtype=..., device=\"pjrt\") or torch.empty(...)")
    name = f"torch.cuda.{member}" if member else "torch.cuda"
    return Rule("torch-cuda", "needs-work", f"{name} has no pjrt equivalent: remove it or guard it for CUDA only")


def amp_rule(member: str) -> Rule:
    if member == "autocast":
        return Rule("amp", "mechanical", "torch.autocast(\"pjrt\", ...)")
    if member == "GradScaler":
        return Rule("amp", "mechanical", "torch.amp.GradScaler(\"pjrt\", ...)")
    if member in ("custom_fwd", "custom_bwd"):
        return Rule("amp", "needs-work", f"torch.amp.{member}(device_type=\"pjrt\")")
    return Rule("amp", "needs-work", "use torch.amp with device type \"pjrt\"")


def nccl_rule() -> Rule:
    return Rule("nccl", "needs-work",
                "drop the NCCL backend name: init_process_group() without a backend picks the accelerator's")


def backend_flag_rule(name: str) -> Rule:
    if name.startswith("torch.backends.cuda.matmul.allow_tf32"):
        return Rule("backend-flags", "portable",
                    "works on pjrt: float32 matmuls run at TF32 on GPU and 3-pass bf16 on TPU "
                    "(the same as torch.set_float32_matmul_precision(\"high\")); CPU stays exact")
    return Rule("backend-flags", "portable", "no effect on pjrt (XLA chooses its own kernels); keep or remove")


def rule_for(qualified: str) -> Rule | None:
    """The rule for a fully qualified dotted name, or None when it is not CUDA-specific."""
    if qualified == "torch.cuda" or qualified.startswith("torch.cuda."):
        parts = qualified.split(".", 3)[2:]
        return torch_cuda_rule(parts[0] if parts else "", parts[1] if len(parts) > 1 else "")
    if qualified.startswith(("torch.backends.cudnn", "torch.backends.cuda")):
        return backend_flag_rule(qualified)
    if qualified.startswith("torch.utils.cpp_extension"):
        return Rule("extension", "blocker", f"a custom CUDA/C++ extension: {KERNEL_HINT}")
    if qualified in ("torch.distributed.is_nccl_available", "torch.distributed.Backend.NCCL"):
        return nccl_rule()
    return None


def dotted(node: cst.BaseExpression) -> str:
    return cst.Module([]).code_for_node(node)


def snippet(node: cst.CSTNode) -> str:
    text = " ".join(cst.Module([]).code_for_node(node).split())
    return text if len(text) <= 70 else text[:67] + "..."


def literal_int(node: cst.BaseExpression) -> int | None:
    if isinstance(node, cst.Integer):
        return int(node.value)
    return None


def cuda_method_call(call: cst.Call) -> cst.Call | None:
    """`x.cuda()` / `x.cuda(1)` / `x.cuda(non_blocking=True)` as `x.to("pjrt[:N]", ...)`, else None."""
    device, rest = "pjrt", []
    for arg in call.args:
        keyword = arg.keyword.value if arg.keyword else None
        if keyword in (None, "device") and device == "pjrt" and literal_int(arg.value) is not None:
            device = f"pjrt:{literal_int(arg.value)}"
        elif keyword in ("non_blocking", "memory_format"):
            rest.append(arg)
        else:
            return None
    func = call.func.with_changes(attr=cst.Name("to"))
    return call.with_changes(func=func, args=[cst.Arg(cst.SimpleString(f'"{device}"')), *rest])


AUTOCAST_POSITIONAL = ("enabled", "dtype", "cache_enabled")


def autocast_call(call: cst.Call) -> cst.Call | None:
    """torch.cuda.amp.autocast(...) as torch.autocast("pjrt", ...); its positional order differs."""
    args = [cst.Arg(cst.SimpleString('"pjrt"'))]
    for index, arg in enumerate(call.args):
        if arg.star or (arg.keyword is None and index >= len(AUTOCAST_POSITIONAL)):
            return None
        if arg.keyword is None:
            arg = arg.with_changes(keyword=cst.Name(AUTOCAST_POSITIONAL[index]), equal=cst.AssignEqual(
                whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")))
        args.append(arg)
    return call.with_changes(func=cst.parse_expression("torch.autocast"), args=args)


def grad_scaler_call(call: cst.Call) -> cst.Call:
    return call.with_changes(func=cst.parse_expression("torch.amp.GradScaler"),
                             args=[cst.Arg(cst.SimpleString('"pjrt"')), *call.args])


CALL_REWRITES: dict[str, Callable[[cst.Call], cst.Call | None]] = {
    "torch.cuda.amp.autocast": autocast_call,
    "torch.cuda.amp.GradScaler": grad_scaler_call,
}


class Scanner(cst.CSTTransformer):
    """Finds CUDA dependence; with `fix`, also rewrites the mechanical cases in the same pass."""

    METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider, ParentNodeProvider)

    def __init__(self, path: str, fix: bool) -> None:
        super().__init__()
        self.path = path
        self.fix = fix
        self.findings: list[Finding] = []
        self.replacements: dict[int, Callable[[Any], cst.CSTNode | None]] = {}
        self.uses_torch = False

    def line(self, node: cst.CSTNode) -> int:
        return self.get_metadata(PositionProvider, node).start.line

    def report(self, node: cst.CSTNode, rule: Rule, rewrite: Callable[[Any], cst.CSTNode | None] | None,
               target: cst.CSTNode | None = None) -> None:
        """Record a finding on `node`; `rewrite` (applied to `target`, default `node`) makes it fixable."""
        self.findings.append(Finding(self.path, self.line(node), rule.category, rule.severity, rule.suggestion,
                                     snippet(node), rewrite is not None))
        if rewrite is not None and self.fix:
            self.replacements[id(target or node)] = rewrite

    def qualified(self, node: cst.CSTNode) -> list[str]:
        names = self.get_metadata(QualifiedNameProvider, node, set())
        return sorted(name.name for name in names)

    def parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self.get_metadata(ParentNodeProvider, node, None)

    # --- imports and kernels -------------------------------------------------------------------

    def visit_Import(self, node: cst.Import) -> bool:  # noqa: N802 (libcst's naming)
        for alias in node.names:
            self.check_import(node, dotted(alias.name))
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:  # noqa: N802 (libcst's naming)
        if node.module is not None and not node.relative:
            self.check_import(node, dotted(node.module))
        return False

    def check_import(self, node: cst.CSTNode, module: str) -> None:
        category = BLOCKER_IMPORTS.get(module.split(".")[0])
        if category == "triton":
            self.report(node, Rule("triton", "blocker", f"Triton compiles for CUDA/ROCm: {KERNEL_HINT}"), None)
        elif category:
            self.report(node, Rule(category, "blocker",
                                   f"{module.split('.')[0]} needs a CUDA device: move the array work to torch "
                                   "on pjrt, or to JAX via torch_pjrt.kernels.jax_op (docs/kernels.md)"), None)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:  # noqa: N802 (libcst's naming)
        for decorator in node.decorators:
            target = decorator.decorator
            target = target.func if isinstance(target, cst.Call) else target
            if any(name.startswith("triton.") for name in self.qualified(target)):
                self.report(decorator, Rule("triton", "blocker", f"Triton kernel {node.name.value}: {KERNEL_HINT}"),
                            None)

    # --- names: torch.cuda.*, backends flags, extensions, nccl ------------------------------------

    def is_inner(self, node: cst.BaseExpression) -> bool:
        """True for `a` and `a.b` inside `a.b.c`: only the whole dotted name is judged."""
        parent = self.parent(node)
        return isinstance(parent, cst.Attribute) and parent.value is node

    def visit_Attribute(self, node: cst.Attribute) -> bool:  # noqa: N802 (libcst's naming)
        if self.is_inner(node):
            return True
        if node.attr.value == "is_cuda":
            self.report(node, Rule("cuda-method", "mechanical", "x.device.type == \"pjrt\""), None)
            return False
        return not self.check_name(node)

    def visit_Name(self, node: cst.Name) -> bool:  # noqa: N802 (libcst's naming)
        if not self.is_inner(node):
            self.check_name(node)
        return False

    def check_name(self, node: cst.BaseExpression) -> bool:
        for name in self.qualified(node):
            rule = rule_for(name)
            if rule is None:
                continue
            call = self.parent(node)
            if name in CALL_REWRITES and isinstance(call, cst.Call) and call.func is node:
                rewrite = CALL_REWRITES[name]
                fixable = rewrite(call) is not None
                self.report(node, rule, rewrite if fixable else None, target=call)
            elif rule.replacement:
                self.report(node, rule, lambda _, dotted_name=rule.replacement: cst.parse_expression(dotted_name))
            else:
                self.report(node, rule, None)
            return True
        return False

    # --- method calls and strings ----------------------------------------------------------------

    def visit_Call(self, node: cst.Call) -> None:  # noqa: N802 (libcst's naming)
        func = node.func
        if not (isinstance(func, cst.Attribute) and func.attr.value == "cuda"):
            return
        if any(name.startswith(("torch.cuda", "cupy", "numba")) for name in self.qualified(func)):
            return
        fixable = cuda_method_call(node) is not None
        self.report(node, Rule("cuda-method", "mechanical", ".to(\"pjrt\")"),
                    cuda_method_call if fixable else None)

    def visit_SimpleString(self, node: cst.SimpleString) -> None:  # noqa: N802 (libcst's naming)
        value = node.evaluated_value
        if not isinstance(value, str):
            return
        if DEVICE_STRING.fullmatch(value):
            device = value.replace("cuda", "pjrt", 1)
            self.report(node, Rule("device-string", "mechanical", f'"{device}"'),
                        lambda updated: updated.with_changes(value=updated.value.replace("cuda", "pjrt", 1)))
        elif value == "nccl":
            self.report(node, nccl_rule(), None)

    def visit_FormattedString(self, node: cst.FormattedString) -> None:  # noqa: N802 (libcst's naming)
        first = node.parts[0] if node.parts else None
        if isinstance(first, cst.FormattedStringText) and first.value.startswith("cuda:"):
            def rewrite(updated: cst.FormattedString) -> cst.FormattedString:
                head = updated.parts[0].with_changes(value=updated.parts[0].value.replace("cuda", "pjrt", 1))
                return updated.with_changes(parts=[head, *updated.parts[1:]])

            self.report(node, Rule("device-string", "mechanical", "f\"pjrt:...\""), rewrite)

    # --- applying rewrites -------------------------------------------------------------------------

    def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode) -> Any:
        rewrite = self.replacements.pop(id(original), None)
        if rewrite is None:
            return updated
        replaced = rewrite(updated)
        self.uses_torch = self.uses_torch or "torch." in cst.Module([]).code_for_node(replaced)
        return replaced


@dataclasses.dataclass
class FileResult:
    path: str
    findings: list[Finding]
    source: str = ""
    fixed: str | None = None
    error: str | None = None


def syntax_error(path: str, source: str) -> str | None:
    """Python's own message for a syntax error (libcst's positions are less precise), else None."""
    try:
        compile(source, path, "exec", flags=ast.PyCF_ONLY_AST, dont_inherit=True)
    except SyntaxError as error:
        return f"{path}:{error.lineno}:{error.offset or 0}: syntax error: {error.msg}"
    return None


def scan_python(path: str, source: str, fix: bool = False) -> FileResult:
    error = syntax_error(path, source)
    if error is None and not any(word in source.lower() for word in KEYWORDS):
        return FileResult(path, [], source, source if fix else None)
    if error is None:
        try:
            module = cst.parse_module(source)
        except cst.ParserSyntaxError as parse_error:
            error = f"{path}:{parse_error.raw_line}:{parse_error.raw_column}: syntax error: {parse_error.message}"
    if error is not None:
        return FileResult(path, [], source, error=error)
    scanner = Scanner(path, fix)
    wrapper = MetadataWrapper(module)
    fixed = wrapper.visit(scanner)
    if fix and scanner.uses_torch:
        context = CodemodContext()
        AddImportsVisitor.add_needed_import(context, "torch")
        fixed = AddImportsVisitor(context).transform_module(fixed)
    findings = sorted(scanner.findings, key=lambda f: f.line)
    return FileResult(path, findings, source, fixed.code if fix else None)


def scan_cuda_source(path: str, source: str) -> FileResult:
    lines = source.splitlines()
    line = next((i + 1 for i, text in enumerate(lines) if "__global__" in text), 1)
    rule = Rule("extension", "blocker", f"CUDA source file: {KERNEL_HINT}")
    return FileResult(path, [Finding(path, line, rule.category, rule.severity, rule.suggestion, "CUDA source")])


def scan_file(path: str, fix: bool = False) -> FileResult:
    try:
        with open(path, encoding="utf-8") as handle:
            source = handle.read()
    except (OSError, UnicodeDecodeError) as error:
        return FileResult(path, [], error=f"{path}: cannot read: {error}")
    if path.endswith(CUDA_SOURCE_SUFFIXES):
        return scan_cuda_source(path, source)
    return scan_python(path, source, fix)


def walk(paths: list[str]) -> Iterator[str]:
    """Python and CUDA source files under the given paths (hidden and cache folders skipped)."""
    for path in paths:
        if os.path.isfile(path):
            yield path
            continue
        for root, folders, files in os.walk(path):
            folders[:] = sorted(f for f in folders if not f.startswith(".") and f not in SKIPPED_FOLDERS)
            for name in sorted(files):
                if name.endswith((".py", *CUDA_SOURCE_SUFFIXES)):
                    yield os.path.join(root, name)


def unified_diff(result: FileResult) -> str:
    """A git-style diff (a/ and b/ prefixes) for files below the working folder, else absolute paths."""
    from torch_pjrt.cli.run import shown_path

    shown = shown_path(result.path)
    before, after = (shown, shown) if os.path.isabs(shown) else (f"a/{shown}", f"b/{shown}")
    return "".join(difflib.unified_diff(result.source.splitlines(keepends=True),
                                        (result.fixed or "").splitlines(keepends=True), before, after))


def format_text(findings: list[Finding]) -> str:
    lines = [f"{f.file}:{f.line}: {SEVERITIES[f.severity]}: {f.category}: {f.code} -> {f.suggestion}"
             + (" [fixable]" if f.fixable else "") for f in findings]
    counts = Counter(f.severity for f in findings)
    files = len({f.file for f in findings})
    summary = ", ".join(f"{counts[key]} {label}" for key, label in SEVERITIES.items() if counts[key])
    fixable = sum(f.fixable for f in findings)
    lines.append(f"{len(findings)} finding(s) in {files} file(s)" + (f": {summary}" if summary else "")
                 + (f"; {fixable} fixable with --fix" if fixable else ""))
    return "\n".join(lines)


def command(args: argparse.Namespace) -> int:
    missing = [path for path in args.paths if not os.path.exists(path)]
    for path in missing:
        print(f"torch-pjrt scan: {path}: no such file or directory", file=sys.stderr)
    results = [scan_file(path, fix=args.fix or args.diff) for path in walk([p for p in args.paths if p not in missing])]
    findings = [finding for result in results for finding in result.findings]
    for result in results:
        if result.error:
            print(f"torch-pjrt scan: {result.error}", file=sys.stderr)
        elif result.fixed is not None and result.fixed != result.source:
            print(unified_diff(result), end="", file=sys.stderr if args.format == "json" else sys.stdout)
            if args.fix:
                with open(result.path, "w", encoding="utf-8") as handle:
                    handle.write(result.fixed)
    if args.format == "json":
        print(json.dumps([finding.as_dict() for finding in findings], indent=2))
    else:
        print(format_text(findings))
    return 1 if missing or any(result.error for result in results) else 0


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "scan", help="inventory CUDA dependence in Python code (parsed, not grepped)",
        description="Report every CUDA-specific construct with its severity and the pjrt replacement.")
    parser.add_argument("paths", nargs="+", metavar="PATH", help="files or folders to scan")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--fix", action="store_true", help="apply the mechanical rewrites in place and show the diff")
    parser.add_argument("--diff", action="store_true", help="show the diff --fix would apply, change nothing")
    parser.set_defaults(func=command)

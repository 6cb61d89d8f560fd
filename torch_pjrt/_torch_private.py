"""Every private PyTorch API torch_pjrt touches, in one place.

A torch upgrade that moves one of these should only need this file changed.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import io
import os
import pickle
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

CPU_KEYSET = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_ALIAS = torch.ops.aten.alias.default._handle
_SET_STORAGE = torch.ops.aten.set_.source_Storage_storage_offset._handle
_construct_storage = torch._C._construct_storage_from_data_pointer


def setup_backend(name: str, device_module: Any, hooks: Any, guard: Any) -> None:
    """Rename PrivateUse1 and register the device module, hooks and guard."""
    _setup_privateuseone_for_python_backend(name, device_module, hooks, guard)


def hooks_base() -> type:
    return torch._C._acc.PrivateUse1Hooks


def guard_base() -> type:
    return torch._C._acc.DeviceGuard


def privateuse1_device_type() -> Any:
    return torch._C._autograd.DeviceType.PrivateUse1


def redispatch_cpu(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    """Run the CPU kernel of a metadata-only op (views, set_) on device tensors."""
    return op._handle.redispatch_boxed(CPU_KEYSET, *args, **kwargs)


# --- tensor creation --------------------------------------------------------------------
# A template tensor per (device index, dtype) is made once through DLPack's kDLExtDev
# device type, which PyTorch maps to PrivateUse1 with the right index; new tensors are
# aliases of it re-pointed at a fresh storage (about 4 us, no data touched).

_DL_EXT_DEV = 12
_DL_CODES = {
    torch.bool: (6, 8),
    torch.uint8: (1, 8),
    torch.uint16: (1, 16),
    torch.uint32: (1, 32),
    torch.uint64: (1, 64),
    torch.int8: (0, 8),
    torch.int16: (0, 16),
    torch.int32: (0, 32),
    torch.int64: (0, 64),
    torch.float16: (2, 16),
    torch.bfloat16: (4, 16),
    torch.float32: (2, 32),
    torch.float64: (2, 64),
    torch.complex64: (5, 64),
    torch.complex128: (5, 128),
    torch.float8_e4m3fn: (10, 8),
    torch.float8_e4m3fnuz: (11, 8),
    torch.float8_e5m2: (12, 8),
    torch.float8_e5m2fnuz: (13, 8),
    torch.float8_e8m0fnu: (14, 8),
}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_DL_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DL_DELETER)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

_templates: dict[tuple[int, torch.dtype], torch.Tensor] = {}
_template_structs: list[Any] = []


def _template(index: int, dtype: torch.dtype) -> torch.Tensor:
    key = (index, dtype)
    tensor = _templates.get(key)
    if tensor is None:
        code, bits = _DL_CODES[dtype]
        shape = (ctypes.c_int64 * 1)(0)
        strides = (ctypes.c_int64 * 1)(1)
        managed = _DLManagedTensor()
        managed.dl_tensor.data = 0
        managed.dl_tensor.device = _DLDevice(_DL_EXT_DEV, index)
        managed.dl_tensor.ndim = 1
        managed.dl_tensor.dtype = _DLDataType(code, bits, 1)
        managed.dl_tensor.shape = shape
        managed.dl_tensor.strides = strides
        managed.deleter = _DL_DELETER()
        _template_structs.append((managed, shape, strides))
        capsule = _capsule_new(ctypes.addressof(managed), b"dltensor", None)
        tensor = torch._C._from_dlpack(capsule)
        _templates[key] = tensor
    return tensor


def new_tensor(
    device: torch.device,
    dtype: torch.dtype,
    sizes: Any,
    strides: Any,
    offset: int,
    address: int,
    nbytes: int,
) -> tuple[torch.Tensor, Any]:
    """A PrivateUse1 tensor over a new non-owning storage at a fake address."""
    tensor = _ALIAS.redispatch_boxed(CPU_KEYSET, _template(device.index, dtype))
    storage = _construct_storage(address, device, nbytes)
    _SET_STORAGE.redispatch_boxed(CPU_KEYSET, tensor, storage, offset, sizes, strides)
    return tensor, storage


def repoint(tensor: torch.Tensor, storage: Any, offset: int, sizes: Any, strides: Any) -> None:
    _SET_STORAGE.redispatch_boxed(CPU_KEYSET, tensor, storage, offset, sizes, strides)


def new_storage(address: int, device: torch.device, nbytes: int) -> Any:
    return _construct_storage(address, device, nbytes)


def has_kernel(name: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, key)


def operator_schemas(qualified: str) -> list[torch.FunctionSchema]:
    """Every overload's schema of an operator ("aten::add"), in its packet's order; [] for no operator."""
    return torch._C._jit_get_schemas_for_operator(qualified)


def library_fallback(fn: Any, key: str) -> torch.library.Library:
    lib = torch.library.Library("_", "IMPL")
    lib.fallback(fn, key)
    return lib


def exclude_key(key: str) -> Any:
    """Context that excludes a dispatch key (used by autocast kernels to re-dispatch)."""
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key)))


def composite_kernel(op: torch._ops.HigherOrderOperator) -> Callable[..., Any] | None:
    """A higher-order op's CompositeExplicitAutograd kernel (flex_attention's: its dense math in ATen ops)."""
    return op.py_kernels.get(torch._C.DispatchKey.CompositeExplicitAutograd)


# Packages whose frames run inside our kernels: Dynamo must never try to compile them.
DYNAMO_SKIPPED = ("torch_pjrt", "jax", "jaxlib", "ml_dtypes", "opt_einsum")


@functools.cache
def dynamo_skip_our_packages() -> None:
    """Keep Dynamo from compiling our kernels' and jax's frames (they run under compiled code).

    Once per process: each addition recompiles Dynamo's skip patterns (about 17 ms)."""
    from torch._dynamo import trace_rules

    for name in DYNAMO_SKIPPED:
        trace_rules.add(name)


def dynamo_guard_checks(code: types.CodeType) -> list[Callable[[dict[str, Any]], bool]]:
    """The guard checks of the frames Dynamo compiled for `code`, in the order a call tries them (the
    last one used first); each takes the frame's locals. Benchmarks time them."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return [entry.guard_manager.check for entry in _debug_get_cache_entry_list(code)]


def dynamo_undisabled(fn: Any) -> Any:
    """What a Dynamo `disable` wrapper around `fn` (torch._dynamo.disable, torch._disable_dynamo, both nested)
    runs, or `fn` itself: for code called where no Dynamo frame evaluation is on, which the wrappers' resets of
    it (four set_eval_frame calls a call) only cost."""
    while True:
        if getattr(fn, "_torchdynamo_disable", False):
            fn = fn._torchdynamo_orig_callable
        elif getattr(fn, "__code__", None) is _disable_dynamo_wrapper_code():
            fn = fn.__wrapped__
        else:
            return fn


@functools.cache
def _disable_dynamo_wrapper_code() -> types.CodeType:
    """The code of torch._disable_dynamo's wrapper (every function it decorates shares it)."""
    return torch._disable_dynamo(lambda: None).__code__


def min_cut_partition() -> Callable[..., Any]:
    """AOTAutograd's min-cut partitioner (Inductor's): views and cheap ops of the forward are recomputed in
    the backward instead of saved, so a compiled forward hands fewer tensors over."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition


@functools.cache
def dynamo_optimizer_without_cudagraph_import() -> None:
    """Let Dynamo trace `optimizer.step()` on non-CUDA tensors without importing Inductor's CUDA graph trees.

    Dynamo asks `_is_static_for_cudagraphs` of every optimizer state tensor; it imports
    torch._inductor.cudagraph_trees (all of Inductor's compile_fx, about 1 s) and answers True for
    any tensor not on CUDA. Those tensors now get the same True without the import; CUDA tensors go
    to PyTorch's function as before, so no backend's behaviour changes."""
    from torch._dynamo.variables import optimizer

    original = optimizer._is_static_for_cudagraphs

    def is_static_for_cudagraphs(tensor: torch.Tensor) -> bool:
        return True if not tensor.is_cuda else original(tensor)

    optimizer._is_static_for_cudagraphs = is_static_for_cudagraphs


def dynamo_optimizer_capturable_on(device_type: str) -> None:
    """Let Dynamo make an optimizer capturable when its parameters are on `device_type`, as it does on CUDA.

    Dynamo traces `optimizer.step()` with the capturable update and sets `capturable=True` on a param group
    whose state is not made yet only when its parameters are on CUDA or XPU; elsewhere the real state keeps
    its step counts on the CPU, so every compiled step updates them in torch outside the program and sends
    them to the device (AdamW: one per parameter). Groups on `device_type` now get the flag as CUDA's do, so
    their step counts are device tensors updated inside the program; other devices are left as they were."""
    from torch._dynamo.variables import optimizer

    original = optimizer.OptimizerVariable._set_capturable

    def set_capturable(self: Any, tx: Any) -> None:
        for group in self.value.param_groups:
            params = group.get("params", [])
            if "capturable" in group and params and all(
                    p.device.type == device_type and p not in self.value.state for p in params):
                group["capturable"] = True
        original(self, tx)

    optimizer.OptimizerVariable._set_capturable = set_capturable


def flex_attention_accepts(device_type: str) -> None:
    """Add `device_type` to the devices eager FlexAttention takes (its check is a fixed set of types).

    torch.nn.attention.flex_attention._validate_device refuses any device outside the set literal
    {"cuda", "cpu", "xpu", "hpu", "mps"}, though its eager path runs the higher-order op's dense
    implementation (plain torch ops) that any backend runs. The check is rebuilt from its own code with
    `device_type` in that set, so every other device meets PyTorch's check unchanged and the check stays in
    PyTorch's file, which Dynamo traces inside compiled graphs (a wrapper of ours would be a frame it skips,
    dynamo_skip_our_packages). A torch whose check holds no such set is left alone."""
    from torch.nn.attention import flex_attention

    check = flex_attention._validate_device
    code = check.__code__
    constants = tuple(constant | {device_type} if isinstance(constant, frozenset) and "cuda" in constant
                      else constant for constant in code.co_consts)
    if constants == code.co_consts:  # no such set, or the type is in it already
        return
    flex_attention._validate_device = types.FunctionType(code.replace(co_consts=constants), check.__globals__,
                                                         check.__name__, check.__defaults__, check.__closure__)


@contextlib.contextmanager
def flex_attention_backward_on_cpu() -> Iterator[None]:
    """FlexAttention with gradients on CPU tensors, for CPU references of models that use it.

    PyTorch refuses it in the device check only (`does not support backward on CPU`): its eager dense path
    differentiates on any device. The check is restored at the end unless something replaced it meanwhile."""
    from torch.nn.attention import flex_attention

    check = flex_attention._validate_device

    def check_without_gradients(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        check(query.detach(), key.detach(), value.detach())

    flex_attention._validate_device = check_without_gradients
    try:
        yield
    finally:
        if flex_attention._validate_device is check_without_gradients:
            flex_attention._validate_device = check


# c10::ScalarType numbering, for schema defaults that arrive as plain numbers.
_SCALAR_TYPES = {
    0: torch.uint8, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.int64, 5: torch.float16,
    6: torch.float32, 7: torch.float64, 9: torch.complex64, 10: torch.complex128, 11: torch.bool,
    15: torch.bfloat16,
}


def scalar_type(number: int) -> torch.dtype:
    return _SCALAR_TYPES[number]


def symbol_upper_bound(size: torch.SymInt, symbol: Any) -> int | None:
    """The largest value the shape environment allows a size symbol, or None when unbounded."""
    from torch.utils._sympy.numbers import IntInfinity

    ranges = size.node.shape_env.var_to_range
    if symbol not in ranges or isinstance(ranges[symbol].upper, IntInfinity) or not ranges[symbol].upper.is_number:
        return None
    return int(ranges[symbol].upper)


def size_functions() -> dict[str, Any]:
    """The sympy functions torch's size expressions use (FloorDiv, CeilDiv, Mod, Max, Min)."""
    from torch.utils._sympy import functions

    return {name: getattr(functions, name) for name in ("FloorDiv", "CeilDiv", "Mod", "Max", "Min")}


def symbolic_fake_mode(values: list[int]) -> tuple[Any, Any, list[Any], list[torch.SymInt]]:
    """A fake-tensor mode over a fresh shape environment with one size symbol per value (each given
    its value as hint): PyTorch's meta kernels then say how results' sizes depend on the symbols.
    Returns the environment (its `guards` list what the kernels assumed), the mode, the sympy
    symbols and their SymInts."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv(duck_shape=False)
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    # its symbols are new, so no result it could cache is met again: caching them only costs (half the run)
    mode.cache_enabled = False
    symbols, sizes = [], []
    for position, value in enumerate(values):
        symbol = env.create_symbol(value, ConstantSource(f"pjrt_size{position}"), dynamic_dim=DimDynamic.DYNAMIC)
        symbols.append(symbol)
        sizes.append(env.create_symintnode(symbol, hint=value))
    return env, mode, symbols, sizes


_DYNAMO_MARKS = ("_has_dynamo_dim_marking", "_specialize_on", "_dynamo_dynamic_indices", "_dynamo_dynamic_range",
                 "_dynamo_hint_overrides")


def copy_dynamo_marks(source: torch.Tensor, target: torch.Tensor) -> None:
    """Carry torch._dynamo.mark_dynamic's marks (tensor attributes) from a tensor to its device copy."""
    for name in _DYNAMO_MARKS:
        if name in source.__dict__:
            value = source.__dict__[name]
            target.__dict__[name] = value.copy() if hasattr(value, "copy") else value


def mark_dynamic(tensor: torch.Tensor, dims: list[int]) -> None:
    """torch._dynamo.mark_dynamic: Dynamo traces these dims of `tensor` as symbols, wherever it reads it."""
    from torch._dynamo import mark_dynamic as mark

    mark(tensor, dims)


def traced_by_dynamo(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (and what it calls) traced by Dynamo although torch_pjrt's frames are skipped
    (dynamo_skip_our_packages): for code of ours that belongs inside a user's compiled graph."""
    from torch._dynamo import dont_skip_tracing

    return dont_skip_tracing(fn)


def dynamo_traces_our_code() -> contextlib.AbstractContextManager[Any]:
    """Within it, Dynamo treats torch_pjrt's frames as user code: torch.compile made there of a function of ours
    compiles that function's own frame (not a wrapper frame of torch's), as vLLM's bytecode hook needs."""
    from torch._dynamo import dont_skip_tracing

    return dont_skip_tracing()


def suggest_memory_format(tensor: torch.Tensor) -> torch.memory_format:
    """The memory format PyTorch's kernels give a result made from `tensor` (channels-last stays so)."""
    from torch._prims_common import suggest_memory_format as suggest

    return suggest(tensor)


def wrap_module_apply(make: Any) -> None:
    """Replace torch.nn.Module._apply (what .to(), .cuda(), .half() run) by `make(original)`, once."""
    original = torch.nn.Module._apply
    if not getattr(original, "_pjrt_wrapped", False):
        wrapped = make(original)
        wrapped._pjrt_wrapped = True
        torch.nn.Module._apply = wrapped


def wrap_inductor_compile(make: Any) -> None:
    """Replace what torch.compile's default backend runs on each graph (Inductor) by `make(original)`, once."""
    wrapper = torch._TorchCompileInductorWrapper
    if not getattr(wrapper.__call__, "_pjrt_wrapped", False):
        wrapped = make(wrapper.__call__)
        wrapped._pjrt_wrapped = True
        wrapper.__call__ = wrapped


def inductor_settings(wrapper: Any) -> dict[str, Any]:
    """The Inductor settings a torch.compile call's mode= and options= asked for."""
    return dict(getattr(wrapper, "config", {}))


def hint(size: Any) -> int:
    """A size as an int: a SymInt's value in the call it was made for (its hint)."""
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


# --- the profiler -------------------------------------------------------------------------------
# PyTorch's profiler has no extension point a Python device can fill (its PrivateUse1 activity
# expects a compiled kineto plugin). torch_pjrt/profiler.py therefore wraps four methods of the
# class behind both torch.profiler.profile and torch.autograd.profiler.profile (torch 2.11-2.13).

_PROFILER_METHODS = ("_start_trace", "__exit__", "_parse_kineto_results", "export_chrome_trace")


def hook_profiler(
    started: Callable[[Any], None],
    stopping: Callable[[Any], None],
    parsed: Callable[[Any, list, int], list],
    exported: Callable[[Any, str], None],
) -> bool:
    """Call `started(profile)` once a profiling window is open, `stopping(profile)` before it closes,
    `parsed(profile, events, trace_start_ns)` on the parsed events, and `exported(profile, path)` after
    a Chrome trace is written; False (and nothing changed) where this torch lacks one of the methods."""
    from torch.autograd import profiler

    cls = profiler.profile
    if getattr(cls, "_torch_pjrt_hooked", False):
        return True
    if not all(callable(getattr(cls, name, None)) for name in _PROFILER_METHODS):
        return False
    start_trace, exit_, parse, export = (getattr(cls, name) for name in _PROFILER_METHODS)

    @functools.wraps(start_trace)
    def hooked_start_trace(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = start_trace(self, *args, **kwargs)
        started(self)
        return result

    @functools.wraps(exit_)
    def hooked_exit(self: Any, *args: Any) -> Any:
        try:
            stopping(self)
        finally:
            result = exit_(self, *args)  # PyTorch's profiler stops even when ours failed
        return result

    @functools.wraps(parse)
    def hooked_parse(self: Any, result: Any, *args: Any, **kwargs: Any) -> Any:
        return parsed(self, parse(self, result, *args, **kwargs), result.trace_start_ns())

    @functools.wraps(export)
    def hooked_export(self: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        result = export(self, path, *args, **kwargs)
        exported(self, path)
        return result

    cls._start_trace, cls.__exit__ = hooked_start_trace, hooked_exit
    cls._parse_kineto_results, cls.export_chrome_trace = hooked_parse, hooked_export
    cls._torch_pjrt_hooked = True
    return True


def profiler_device_event(event_id: int, name: str, thread: int, start_us: float, end_us: float, device_index: int,
                          use_device: str) -> Any:
    """A parsed profiler event of work on the pjrt device (the kind kineto makes for a GPU kernel)."""
    from torch.autograd.profiler_util import FunctionEvent

    return FunctionEvent(id=event_id, name=name, thread=thread, start_us=start_us, end_us=end_us, trace_name=name,
                         input_shapes=[], stack=[], use_device=use_device, device_type=privateuse1_device_type(),
                         device_index=device_index)


@contextlib.contextmanager
def autograd_fallback_mode(mode: str) -> Iterator[None]:
    """Within it, ops without an autograd kernel get PyTorch's autograd fallback `mode` ("nothing": outputs
    do not require grad)."""
    previous = torch._C._get_autograd_fallback_mode()
    torch._C._set_autograd_fallback_mode(mode)
    try:
        yield
    finally:
        torch._C._set_autograd_fallback_mode(previous)


# --- AOTAutograd's cache, holding the pjrt backend's compiled graphs ------------------------


def output_code_base() -> type:
    """The base class AOTAutograd's cache stores a backend's compiled graph as (Inductor's OutputCode)."""
    from torch._inductor.output_code import OutputCode

    return OutputCode


def serializable_aot_compiler(code_type: type, compile_fn: Callable[..., Any]) -> Any:
    """An AOTAutograd compiler whose results (`code_type` instances) AOTAutograd's cache may store."""
    from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler

    return SerializableAOTDispatchCompiler(code_type, compile_fn)


@contextlib.contextmanager
def aot_autograd_cache(folder: str) -> Iterator[None]:
    """Within it, AOTAutograd looks its graphs up in, and stores them into, `folder` (whole entries, the
    compiled graphs pickled in them) and compiles the backward with the forward, so the entry is saved
    before this scope ends. Outside it nothing changes: other backends keep PyTorch's cache settings and
    Inductor's own folder."""
    from unittest import mock

    from torch._functorch import config
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
    from torch._inductor import codecache

    settings = config.patch(enable_autograd_cache=True, bundled_autograd_cache=True,
                            force_non_lazy_backward_lowering=True)
    # The cache key registers Inductor's code generators first (to hash their custom passes): about 160
    # modules a pjrt process never needs otherwise. Ours are keyed without them.
    with settings, mock.patch.object(AOTAutogradCache, "_get_tmp_dir", classmethod(lambda cls: folder)), \
            mock.patch.object(codecache, "init_backend_registration", lambda: None):
        yield


def torch_source_key() -> bytes:
    """PyTorch's digest of its own source files (Inductor's torch_key, part of AOTAutograd's cache keys), computed
    by hashing about 2,600 files (~0.1 s) the first time a process asks."""
    from torch._inductor import codecache

    return codecache.torch_key()


@contextlib.contextmanager
def torch_source_key_given(key: bytes) -> Iterator[None]:
    """Within it, `torch_source_key()` is `key` unless the process had computed it already; afterwards PyTorch
    computes it again when asked (its own cache's `set` and `clear`), so code outside sees no value of ours."""
    from torch._inductor import codecache

    try:
        codecache.torch_key.set(key)
        given = True
    except RuntimeError:  # already computed: PyTorch's own value stays
        given = False
    try:
        yield
    finally:
        if given:
            codecache.torch_key.clear()


def pickle_graph(gm: torch.fx.GraphModule, keep: Callable[[str], bool]) -> bytes:
    """A graph as bytes, with the node metadata entries `keep` names: each node pickled as the call that makes it
    again (`_made_node`), its operators by name, nodes in its arguments as pickle's references to nodes made
    before. What plain pickle cannot write (a tensor constant, a lambda) raises pickle's error. Loads about 3 times
    faster than torch's GraphPickler, which maps every node's arguments with pytree twice."""
    buffer = io.BytesIO()
    graph = gm.graph
    _GraphWriter(buffer, keep).dump((_module_state(gm), graph._tracer_cls, graph._tracer_extras, graph._codegen,
                                     list(graph.nodes)))
    return buffer.getvalue()


def unpickle_graph(data: bytes) -> torch.fx.GraphModule:
    """`pickle_graph`'s graph again, its nodes made in their order, with the module's generated code as stored."""
    gm = torch.fx.GraphModule.__new__(torch.fx.GraphModule)
    graph = torch.fx.Graph(gm)
    module_state, graph._tracer_cls, graph._tracer_extras, graph._codegen, _ = _GraphReader(
        io.BytesIO(data), graph).load()
    gm.__dict__.update(module_state)
    gm._graph = graph
    return gm


def _module_state(gm: torch.fx.GraphModule) -> dict[str, Any]:
    """The module's attributes but its graph, its generated code (`gm.code`) among them (made now if lazy)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    if isinstance(gm, _LazyGraphModule):
        gm._real_recompile()
    else:
        gm.recompile()
    return {key: value for key, value in gm.__dict__.items() if key != "_graph"}


# Stands for the graph being loaded in a pickled node's call.
_GRAPH_BEING_LOADED = "graph"


class _GraphWriter(pickle.Pickler):
    def __init__(self, file: io.BytesIO, keep: Callable[[str], bool]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.keep = keep
        self.graph_token = object()

    def persistent_id(self, obj: Any) -> Any:
        return _GRAPH_BEING_LOADED if obj is self.graph_token else None

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.fx.Node:  # pickle's memo refers to it afterwards
            meta = {key: value for key, value in obj.meta.items() if self.keep(key)}
            return _made_node, (self.graph_token, obj.op, obj.name, obj.target, obj.args, obj.kwargs, obj.type, meta)
        if isinstance(obj, torch._ops.OpOverload):
            return _operator, (obj._schema.name, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return _operator, (obj._qualified_op_name, None)
        if isinstance(obj, torch._ops.HigherOrderOperator):
            return _higher_order_operator, (obj.name(),)
        return NotImplemented


class _GraphReader(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, graph: torch.fx.Graph) -> None:
        super().__init__(file)
        self.graph = graph

    def persistent_load(self, pid: Any) -> Any:
        if pid != _GRAPH_BEING_LOADED:
            raise pickle.UnpicklingError(f"torch_pjrt: a stored graph names {pid!r}, no graph being loaded.")
        return self.graph


def _made_node(graph: torch.fx.Graph, op: str, name: str, target: Any, args: tuple, kwargs: dict, type_: Any,
               meta: dict[str, Any]) -> torch.fx.Node:
    node = graph.create_node(op, target, args, kwargs, name, type_)
    node.meta = meta
    return node


def _higher_order_operator(name: str) -> torch._ops.HigherOrderOperator:
    return getattr(torch.ops.higher_order, name)


def _operator(qualified_name: str, overload: str | None) -> Any:
    """An operator by its schema's name (`aten::add`) and overload name (`Tensor`); None: the packet."""
    namespace, name = qualified_name.split("::")
    packet = getattr(getattr(torch.ops, namespace), name)
    return packet if overload is None else getattr(packet, overload)


def fake_mode() -> Any:
    """A fresh fake tensor mode (tensors with shapes, strides, dtypes and devices, no data)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def fake_tensor(mode: Any, meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor of `mode` on `device` with the layout of the meta tensor `meta`, wrapped directly (a factory
    dispatched through the mode costs about 8 times as much)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor(mode, meta, device)


# --- Dynamo's packages (caching precompile) for one backend's compiles ------------------------


def dynamo_packages_supported() -> bool:
    """Whether this torch has Dynamo's compile packages with the parts `dynamo_packages_for` wraps (torch 2.13)."""
    if torch.torch_version.TorchVersion(torch.__version__) < (2, 13):
        return False
    try:
        from torch._dynamo import convert_frame, eval_frame, package
        from torch._functorch._aot_autograd import autograd_cache
    except ImportError:
        return False
    return all(hasattr(module, name) for module, name in (
        (package, "DiskDynamoStore"), (package, "CompilePackage"), (eval_frame, "_optimize"),
        (eval_frame, "_TorchDynamoContext"), (convert_frame, "ConvertFrameAssert"), (convert_frame, "DynamoOutput"),
        (autograd_cache, "AOTAutogradCachePickler")))


def dynamo_packages_for(backend_name: str, folder: Callable[[], str | None], count: Callable[[str], None],
                        writing: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
    """Let torch.compile(fn, backend=`backend_name`) keep Dynamo's work on fn's own frames in `folder()` (when it
    is not None): such a compile gets a Dynamo package, as with TORCH_CACHING_PRECOMPILE=1, read at
    torch.compile(fn) and written after each frame traced, so a later process runs the stored frames' bytecode
    behind their stored guards instead of tracing them. Other backends' compiles, and this one's with the folder
    off, are unchanged.

    Only frames of fn's module (fn and Dynamo's resume functions) go in: library frames it calls (an optimizer's
    step, whose stored guards would need the optimizer's state made, which a new process has not) are traced as
    before. A frame whose guards cannot be stored is left out instead of failing (torch 2.13 raises there);
    AOTAutograd's cache key holds whether a graph belongs to a package, not the package's random graph name,
    so a frame traced again finds its graphs there; the names a loaded package puts in a module are not given
    again by Dynamo, and its warnings about guards a package drops are not shown. `count` is told of each package
    loaded ("dynamo_package_hits") and written ("dynamo_package_writes"), which happens within `writing()`."""
    import hashlib
    import itertools
    import logging
    import re
    import warnings
    from unittest import mock

    from torch._dynamo import bytecode_transformation, config, convert_frame, decorators, eval_frame, package
    from torch._functorch._aot_autograd import autograd_cache

    original_optimize = eval_frame._optimize
    original_enter = eval_frame._TorchDynamoContext.__call__
    original_convert = convert_frame.ConvertFrameAssert.__call__
    original_build_guards = convert_frame.DynamoOutput.build_guards
    original_reduce_config = autograd_cache.AOTAutogradCachePickler._reduce_aot_config
    original_mark_static = decorators.mark_static_address
    stores: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # this backend's packages -> stores
    converting: list[Any] = []  # this backend's frames being traced for a package

    def store_key(fn: Any) -> str:
        # PyTorch's key (qualified name and first line) and the function's code, so a same-named function of
        # another script is not given this one's frames.
        digest = hashlib.sha256(repr(code_parts(fn.__code__)).encode()).hexdigest()
        return f"{package.CompilePackage.source_id_from_fn(fn)[:32]}-{digest[:32]}"

    def code_parts(code: types.CodeType) -> tuple:
        # A code object's bytecode, names and constants, nested code objects by their parts (not their addresses).
        consts = tuple(code_parts(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts)
        return code.co_filename, code.co_code, code.co_names, consts

    def optimize(rebuild_ctx: Any, backend: Any = "inductor", *args: Any, **kwargs: Any) -> Any:
        name = getattr(backend, "compiler_name", backend)
        where = folder() if name == backend_name and kwargs.get("package") is None else None
        if where is not None and not config.caching_precompile:
            # Frames stored under one torch.compile's settings (the backend's mode and options, dynamic, fullgraph,
            # hooks) are not given to another's.
            settings = repr((getattr(backend, "kwargs", None), sorted((k, repr(v)) for k, v in kwargs.items())))
            made = package.CompilePackage(fn=None, dynamo=None, ignore_inlined_sources=False)
            stores[made] = package.DiskDynamoStore(
                os.path.join(where, hashlib.sha256(settings.encode()).hexdigest()[:16]))
            kwargs["package"] = made
        return original_optimize(rebuild_ctx, backend, *args, **kwargs)

    def enter(self: Any, fn: Any) -> Any:
        made = getattr(self, "_package", None)
        store = None if made is None else stores.get(made)
        fn_key = None if store is None or made.is_initialized() else keyed_function(fn)
        if fn_key is not None:
            key = store_key(fn_key)
            try:
                if not os.path.exists(os.path.join(store.path_prefix(), key)):
                    raise FileNotFoundError(key)
                entry = store.load_cache_entry(key)
                made.initialize(fn_key, entry.dynamo, ignore_inlined_sources=False)
                made.install(entry.backends)
                names_given(made)
                count("dynamo_package_hits")
            except Exception:  # none stored, or another version's or a changed source's: traced and stored afresh
                if made.is_initialized():
                    made.uninstall()
                made.__init__(fn=None, dynamo=None, ignore_inlined_sources=False)  # the frames' package, emptied
                made.initialize(fn_key, None, ignore_inlined_sources=False)
        return original_enter(self, fn)

    def keyed_function(fn: Any) -> Any:
        # The Python function whose frames a package holds (a module's forward), or None for a callable with no code
        # of its own (a partial, an object with __call__: Dynamo traces it through a wrapper frame of its own, which
        # is traced as without packages).
        target = eval_frame.innermost_fn(fn.forward if isinstance(fn, torch.nn.Module) else fn)
        return target if isinstance(getattr(target, "__code__", None), types.CodeType) else None

    def names_given(made: Any) -> None:
        numbers = [int(n) for names in made._installed_globals.values() for name in names
                   for n in re.findall(r"_(\d+)(?=_|$)", name)]
        if numbers:
            bytecode_transformation._unique_id_counter = itertools.count(
                max(next(bytecode_transformation._unique_id_counter), max(numbers) + 1))

    def build_guards(self: Any, *args: Any, save: bool = False, **kwargs: Any) -> Any:
        try:
            check_fn = original_build_guards(self, *args, save=save, **kwargs)
        except Exception as error:  # storing the guards failed in a way torch 2.13 does not catch
            if not save:
                raise
            self.tracer_output.output_graph.bypass_package(f"its guards could not be stored: {error}")
            check_fn = original_build_guards(self, *args, save=False, **kwargs)
        if save and check_fn.guards_state is None:  # the frame was left out of the package (bypassed)
            check_fn.guards_state = b""
        return check_fn

    def reduce_config(self: Any, aot_config: Any) -> Any:
        fn, fields = original_reduce_config(self, aot_config)
        if not fields or fields[-1] != aot_config.precompile_backend_id:
            raise TypeError("torch_pjrt: AOTAutograd's cache key has changed shape; update _torch_private for it.")
        return fn, (*fields[:-1], fields[-1] is not None)

    def convert(self: Any, frame: Any, cache_entry: Any, hooks: Any, frame_state: Any, *, skip: int = 0) -> Any:
        made = self._package
        store = None if made is None else stores.get(made)
        if store is None:
            return original_convert(self, frame, cache_entry, hooks, frame_state, skip=skip + 1)
        if not made.is_initialized() or frame.f_globals is not made._innermost_fn.__globals__:
            # a callable with no code of its own, or a library's frame: traced as without packages
            with mock.patch.object(self, "_package", None):
                return original_convert(self, frame, cache_entry, hooks, frame_state, skip=skip + 1)
        marked: list[tuple[torch.Tensor, Any]] = []

        def mark_static_address(tensor: torch.Tensor, guard: bool = False) -> None:
            marked.append((tensor, getattr(tensor, "_dynamo_static_input_type", None)))
            original_mark_static(tensor, guard=guard)

        converting.append(made)
        with config.patch(caching_precompile=True), warnings.catch_warnings(), \
                mock.patch.object(decorators, "mark_static_address", mark_static_address), \
                mock.patch.object(convert_frame.DynamoOutput, "build_guards", build_guards), \
                mock.patch.object(autograd_cache.AOTAutogradCachePickler, "_reduce_aot_config", reduce_config):
            warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
            try:
                result = original_convert(self, frame, cache_entry, hooks, frame_state, skip=skip + 1)
            finally:
                # A later process runs this frame without tracing it, so without the static marks its trace leaves
                # on tensors (a parameter's grad): traces of later frames see the same marks in both processes,
                # and AOTAutograd's cache keys (which hold the static inputs) match.
                for tensor, before in reversed(marked):
                    if before is None:
                        del tensor._dynamo_static_input_type
                    else:
                        tensor._dynamo_static_input_type = before
                converting.pop()
            try:
                with writing():
                    store.save_package(made, store_key(made._innermost_fn))
                count("dynamo_package_writes")
            except Exception:  # a graph AOTAutograd's cache did not hold (symbolic sizes): the frames are not stored
                pass
        return result

    for logger, message in (("torch._dynamo.guards", "is dropped with caching_precompile"),
                            ("torch._dynamo.output_graph", "Detected a package bypass")):
        logging.getLogger(logger).addFilter(
            lambda record, message=message: not (converting and message in str(record.msg)))
    eval_frame._optimize = optimize
    eval_frame._TorchDynamoContext.__call__ = enter
    convert_frame.ConvertFrameAssert.__call__ = convert

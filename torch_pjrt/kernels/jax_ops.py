"""jax_op: a JAX function (Pallas kernels included) as a PyTorch custom op on pjrt tensors.

The op is a `torch.library` custom op whose schema comes from the function's annotations. Its
PrivateUse1 kernel is the ordinary strict-eager dispatcher (eager/dispatch.py) with one lowering
in the table (ops/registry.py) that calls the function on jax arrays, so the same entry serves
strict eager, fused eager (recorded into the pending program) and torch.compile graphs (one node
lowered inside the graph's program). Its fake kernel is `jax.eval_shape` of the function, so
Dynamo, AOTAutograd and the meta kernels that strict eager asks for never run it.

Its PrivateUse1 kernel is the native one of aten ops (csrc/dispatch.cpp): a call signature seen before replays
its cached program with no Python of ours; ops with donated arguments keep the Python kernel.
"""

from __future__ import annotations

import collections.abc
import functools
import hashlib
import inspect
import operator
import pathlib
import types
import typing
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from torch_pjrt import native, storage
from torch_pjrt.eager import dispatch
from torch_pjrt.kernels import symbolic_sizes
from torch_pjrt.ops import registry
from torch_pjrt.runtime import client

# dtypes that need jax's 64-bit mode: a kernel with one of them among its arguments is traced with it on
WIDE_DTYPES = frozenset(np.dtype(name) for name in ("float64", "int64", "uint64", "complex128"))
STATIC_TYPES = (int, float, bool, str, type(None))


def interpret_mode() -> bool:
    """Whether Pallas kernels should run in interpret mode (`pallas_call(..., interpret=...)`): on
    the CPU platform, which has no Pallas compiler; on GPU and TPU kernels compile for real."""
    return client.platform() == "cpu"


def jax_op(name: str, fn: Callable | None = None, /, *, donate_argnums: int | tuple[int, ...] | None = None,
           vjp: str | None = None) -> Any:
    """A `torch.library` custom op `name` ("namespace::op") running the JAX function `fn` on pjrt tensors.

    Tensor parameters (annotated `jax.Array` or `torch.Tensor`) arrive as jax arrays; every other
    parameter is static (part of the program's cache key). Returns the op's `CustomOpDef`; without
    `fn` it is a decorator. `vjp="auto"` derives the backward with `jax.vjp`, recomputing the forward.
    `donate_argnums` (TorchTPU's spelling) names tensor arguments the caller will not read again: in
    strict eager their buffers are donated to the program (XLA writes a result into one where shape
    and dtype allow, as an in-place kernel's `input_output_aliases` needs) and the tensors are
    consumed, a later read raising. Where autograd may keep the inputs (an input that requires grad)
    and in fused or compiled programs (which reuse buffers themselves) nothing is donated.
    """
    if fn is None:
        return lambda function: jax_op(name, function, donate_argnums=donate_argnums, vjp=vjp)
    return define(name, fn, donate_argnums, vjp)


def define(name: str, fn: Callable, donate_argnums: Any = None, vjp: str | None = None,
           fake: Callable | None = None, fingerprint: str | None = None) -> Any:
    """jax_op's work; `fake` replaces the eval_shape fake kernel (for ops whose result shapes are
    simple functions of symbolic input sizes), `fingerprint` the one derived from fn's source."""
    _check_name(name)
    if vjp not in (None, "auto"):
        raise ValueError(f"torch_pjrt.kernels.jax_op: {name} got vjp={vjp!r}; pass vjp='auto' to derive the "
                         f"backward with jax.vjp, or leave it None and call register_autograd.")
    signature = schema_signature(name, fn)
    tensor_names = [p.name for p in signature.parameters.values() if _holds_tensor(p.annotation)]
    donated = _check_donated(name, signature, donate_argnums)
    op_def = torch.library.custom_op(name, _refuse_host(name), mutates_args=(), schema=_schema(signature))
    overload = _overload(name)
    fingerprint = fingerprint or _fingerprint(fn)
    registry.register(overload, fingerprint=fingerprint, donated=donated)(_lowering(name, fn))
    _register_device_kernel(op_def, overload, donated)
    op_def.register_fake(fake or _eval_shape_fake(name, fn, signature))
    if vjp == "auto":
        _derive_backward(name, fn, signature, tensor_names, fingerprint)
    return op_def


def _register_device_kernel(op_def: Any, overload: Any, donated: tuple[int, ...]) -> None:
    """The op's pjrt kernel: the native one of aten ops (csrc/dispatch.cpp: a seen call signature replays its
    cached program with no Python of ours), or, without the native module or for an op with donated
    arguments (whether a call donates depends on grad mode and the eager mode, which the native key does not
    hold), the Python kernel. A call on pjrt tensors comes after the device's start, which configured the
    native module's miss path (dispatch.configure_native), so the native kernel may be registered before."""
    plan = dispatch.plan_for(overload)
    native_dispatch = native.dispatch_module()
    if native_dispatch is not None and not donated:
        dispatch.register_native(native_dispatch, overload, plan)
    else:
        op_def.register_kernel("pjrt")(dispatch.make_kernel(plan))


# --- names, annotations and the schema -------------------------------------------------------------


def _check_name(name: str) -> None:
    namespace, _, op = name.partition("::")
    if not namespace or not op or not op.isidentifier() or not namespace.isidentifier():
        raise ValueError(f"torch_pjrt.kernels.jax_op: the op name {name!r} needs a namespace, as in "
                         f"'mylib::{name.rpartition(':')[2] or 'my_op'}'.")


def schema_signature(name: str, fn: Callable) -> inspect.Signature:
    """fn's signature in torch types (jax.Array becomes torch.Tensor), without the keywords a
    functools.partial binds (they stay with fn)."""
    try:
        signature = inspect.signature(fn, eval_str=True)
    except NameError as error:
        raise TypeError(f"torch_pjrt.kernels.jax_op: {name}'s annotations cannot be evaluated ({error}); import "
                        f"the names they use at module level.") from None
    bound = set(fn.keywords) if isinstance(fn, functools.partial) else set()
    parameters = []
    for parameter in signature.parameters.values():
        if parameter.name in bound:
            continue
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise TypeError(f"torch_pjrt.kernels.jax_op: {name} takes *{parameter.name}; list every parameter by "
                            f"name so the op has a schema.")
        if parameter.annotation is inspect.Parameter.empty:
            raise TypeError(f"torch_pjrt.kernels.jax_op: {name}'s parameter {parameter.name!r} has no type "
                            f"annotation; annotate every parameter (jax.Array for tensors, int/float/bool/str for "
                            f"static values) and the return.")
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if parameter.kind is inspect.Parameter.POSITIONAL_ONLY \
            else parameter.kind
        parameters.append(parameter.replace(annotation=_torch_type(parameter.annotation), kind=kind))
    if signature.return_annotation is inspect.Signature.empty:
        raise TypeError(f"torch_pjrt.kernels.jax_op: {name} has no return annotation; annotate it (jax.Array, or "
                        f"tuple[jax.Array, ...] for several results).")
    return signature.replace(parameters=parameters, return_annotation=_torch_type(signature.return_annotation))


def _is_jax_array(annotation: Any) -> bool:
    jax = client.jax_module()
    return annotation is jax.Array or annotation is getattr(jax.numpy, "ndarray", None)


def _torch_type(annotation: Any) -> Any:
    """An annotation with every jax array type replaced by torch.Tensor (inside Optional, tuple, list)."""
    if _is_jax_array(annotation):
        return torch.Tensor
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is None or not arguments:
        return annotation
    translated = tuple(_torch_type(a) for a in arguments)
    if origin in (types.UnionType, typing.Union):
        return functools.reduce(operator.or_, translated)
    if origin is collections.abc.Sequence:
        return collections.abc.Sequence[translated[0]]
    return origin[translated]


def _holds_tensor(annotation: Any) -> bool:
    return annotation is torch.Tensor or any(_holds_tensor(a) for a in typing.get_args(annotation))


def _schema(signature: inspect.Signature) -> str:
    def prototype() -> None:
        """Carries the signature for torch.library.infer_schema."""

    prototype.__signature__ = signature  # type: ignore[attr-defined]
    return torch.library.infer_schema(prototype, mutates_args=())


def _check_donated(name: str, signature: inspect.Signature, donate_argnums: Any) -> tuple[int, ...]:
    """The donated parameters' positions (the schema's argument positions too)."""
    if donate_argnums is None:
        return ()
    parameters = list(signature.parameters.values())
    donated = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    for index in donated:
        if not 0 <= index < len(parameters) or parameters[index].annotation is not torch.Tensor:
            raise ValueError(f"torch_pjrt.kernels.jax_op: {name}'s donate_argnums names argument {index}, which is "
                             f"not a tensor parameter; name positions of tensor parameters.")
    return tuple(sorted(set(donated)))


def _overload(name: str) -> torch._ops.OpOverload:
    namespace, _, op = name.partition("::")
    return getattr(getattr(torch.ops, namespace), op).default


def _refuse_host(name: str) -> Callable:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        devices = sorted({str(a.device) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)})
        raise RuntimeError(f"torch_pjrt.kernels: {name} runs on pjrt tensors, but got tensors on "
                           f"{', '.join(devices) or 'no device'}; move its tensor arguments with .to('pjrt').")

    return refuse


def _fingerprint(fn: Callable) -> str:
    """What fn's program depends on that its op name does not say: the source file that defines it,
    the values a functools.partial binds, and its closure's simple values. A function whose source or
    closure cannot be read gets a token of this process, so no later process reuses its programs."""
    digest = hashlib.sha256()
    function = fn
    while isinstance(function, functools.partial):
        digest.update(repr((function.args, sorted(function.keywords.items()))).encode())
        function = function.func
    function = inspect.unwrap(function)
    try:
        digest.update(pathlib.Path(inspect.getsourcefile(function) or "").read_bytes())
    except (OSError, TypeError):
        return f"process-{uuid.uuid4()}"
    digest.update(getattr(function, "__qualname__", "").encode())
    for cell in getattr(function, "__closure__", None) or ():
        value = cell.cell_contents
        if callable(value):
            digest.update(_fingerprint(value).encode())
        elif isinstance(value, STATIC_TYPES + (tuple,)):
            digest.update(repr(value).encode())
        else:
            return f"process-{uuid.uuid4()}"
    return digest.hexdigest()


# --- tracing the function ---------------------------------------------------------------------------


def x64_scope(values: Any) -> Any:
    """jax's 64-bit mode while a kernel is traced: on when an argument is 64-bit (float64, int64), off
    otherwise, which is what jax's own kernels and Pallas's CPU interpret mode assume."""
    jax = client.jax_module()
    wide = any(np.dtype(leaf.dtype) in WIDE_DTYPES for leaf in jax.tree_util.tree_leaves(values)
               if hasattr(leaf, "dtype"))
    return jax.enable_x64(wide)


def _call(fn: Callable, args: tuple, kwargs: dict) -> Any:
    with x64_scope((args, kwargs)):
        return fn(*args, **kwargs)


def _lowering(name: str, fn: Callable) -> Callable:
    def lower(*args: Any, **kwargs: Any) -> Any:
        result = _call(fn, args, kwargs)
        return tuple(result) if isinstance(result, list) else result

    lower.__name__ = f"jax_op_{name.replace('::', '_')}"
    return lower


# ops whose fake kernel fell back to concrete sizes (warned once each)
_specialized: set[str] = set()


def _eval_shape_fake(name: str, fn: Callable, signature: inspect.Signature) -> Callable:
    """The fake kernel: the results' shapes and dtypes from jax.eval_shape of fn."""
    returns_tuple = typing.get_origin(signature.return_annotation) is tuple

    def fake(*args: Any, **kwargs: Any) -> Any:
        jax = client.jax_module()
        devices = [a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]

        # tensors (within lists too) are traced; every other argument stays a Python value
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=lambda v: v is None)
        tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

        def traced(*arrays: Any) -> Any:
            filled = list(leaves)
            for i, array in zip(tensors, arrays):
                filled[i] = array
            traced_args, traced_kwargs = jax.tree_util.tree_unflatten(tree, filled)
            return _call(fn, traced_args, traced_kwargs)

        def results(sizes: symbolic_sizes.SymbolicSizes) -> list[torch.Tensor]:
            shapes = jax.eval_shape(traced, *(
                jax.ShapeDtypeStruct(sizes.shape(tuple(leaves[i].shape)), storage.numpy_dtype(leaves[i].dtype))
                for i in tensors))
            device = devices[0] if devices else torch.device("meta")
            return [torch.empty(tuple(sizes.torch_size(d) for d in shape.shape),
                                dtype=storage.torch_dtype(shape.dtype), device=device)
                    for shape in (list(shapes) if isinstance(shapes, (tuple, list)) else [shapes])]

        value_dependent = (jax.errors.ConcretizationTypeError, jax.errors.NonConcreteBooleanIndexError)
        symbolic = symbolic_sizes.SymbolicSizes(jax)
        try:
            try:
                made = results(symbolic)
            except value_dependent:
                raise
            except Exception as error:
                if not symbolic.sizes:
                    raise
                # A kernel whose tiling needs concrete sizes (a Pallas grid): trace it at this call's sizes,
                # which guards them, so each new size compiles the graph again.
                if name not in _specialized:
                    _specialized.add(name)
                    warnings.warn(f"torch_pjrt.kernels: {name} cannot be traced for symbolic sizes "
                                  f"({str(error).splitlines()[0]}); compiled graphs specialize on its input "
                                  f"sizes and compile again for each new one.", stacklevel=2)
                made = results(symbolic_sizes.SymbolicSizes(jax, specialize=True))
        except value_dependent as error:
            raise RuntimeError(
                f"torch_pjrt.kernels: {name}'s output shapes or control flow depend on its inputs' values "
                f"({str(error).splitlines()[0]}); make them depend on shapes and static arguments only "
                f"(jnp.nonzero(x, size=n), jnp.where, lax.cond).") from None
        return tuple(made) if returns_tuple else made[0]

    return fake


# --- vjp="auto" ------------------------------------------------------------------------------------


def _derive_backward(name: str, fn: Callable, signature: inspect.Signature, tensor_names: list[str],
                     fingerprint: str) -> None:
    """Register autograd for `name`: a second op `name_vjp` computes the input gradients with jax.vjp
    of fn, recomputing the forward inside the backward program (nothing but the inputs is saved)."""
    parameters = list(signature.parameters.values())
    if any(p.annotation is not torch.Tensor for p in parameters if p.name in tensor_names):
        raise TypeError(f"torch_pjrt.kernels.jax_op: {name} has optional or list tensor parameters, which "
                        f"vjp='auto' cannot differentiate; write its backward as another jax_op and call "
                        f"register_autograd.")
    outputs = typing.get_args(signature.return_annotation) or (signature.return_annotation,)
    single = typing.get_origin(signature.return_annotation) is not tuple
    grad_names = _fresh_names([f"grad_{i}" for i in range(len(outputs))], {p.name for p in parameters})
    grads = [inspect.Parameter(g, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=torch.Tensor) for g in grad_names]
    forward = signature.replace(parameters=[p.replace(annotation=inspect.Parameter.empty) for p in parameters])
    jax_module = client.jax_module()

    def backward(*args: Any, **kwargs: Any) -> Any:
        cotangents, rest = args[:len(grad_names)], args[len(grad_names):]
        bound = forward.bind(*rest, **kwargs)
        differentiable = [n for n in tensor_names
                          if jax_module.numpy.issubdtype(bound.arguments[n].dtype, jax_module.numpy.inexact)]

        def of_inputs(*values: Any) -> Any:
            filled = forward.bind(*rest, **kwargs)
            filled.arguments.update(zip(differentiable, values))
            result = fn(*filled.args, **filled.kwargs)
            return tuple(result) if isinstance(result, list) else result

        try:
            primal, pullback = jax_module.vjp(of_inputs, *(bound.arguments[n] for n in differentiable))
        except (ValueError, NotImplementedError) as error:
            raise RuntimeError(
                f"torch_pjrt.kernels: jax.vjp cannot differentiate {name} ({str(error).splitlines()[0]}); a "
                f"pallas_call has no derivative rule: wrap the kernel in jax.custom_vjp, or write the backward as "
                f"another jax_op and call register_autograd.") from None
        primals = [primal] if single else list(primal)
        cotangent = [c.astype(p.dtype) for c, p in zip(cotangents, primals)]
        found = dict(zip(differentiable, pullback(cotangent[0] if single else tuple(cotangent))))
        results = tuple(found.get(n, jax_module.numpy.zeros_like(bound.arguments[n])) for n in tensor_names)
        return results[0] if len(results) == 1 else results

    returns = torch.Tensor if len(tensor_names) == 1 else tuple[(torch.Tensor,) * len(tensor_names)]
    backward.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=grads + parameters, return_annotation=returns)
    def gradient_shapes(*args: Any, **kwargs: Any) -> Any:
        """The backward op's fake: each gradient has its input's shape and dtype (symbolic sizes too)."""
        bound = forward.bind(*args[len(grad_names):], **kwargs)
        found = tuple(torch.empty_like(bound.arguments[n]) for n in tensor_names)
        return found[0] if len(found) == 1 else found

    backward_op = define(f"{name}_vjp", backward, fake=gradient_shapes, fingerprint=fingerprint + "vjp")
    positional = [p.name for p in parameters if p.kind is not inspect.Parameter.KEYWORD_ONLY]

    def setup_context(ctx: Any, inputs: tuple, output: Any, keyword_only_inputs: dict | None = None) -> None:
        values = {**dict(zip(positional, inputs)), **(keyword_only_inputs or {})}
        ctx.static = {n: v for n, v in values.items() if n not in tensor_names}
        ctx.save_for_backward(*(values[n] for n in tensor_names))

    def gradients(ctx: Any, *output_grads: torch.Tensor) -> tuple:
        values = {**ctx.static, **dict(zip(tensor_names, ctx.saved_tensors))}
        found = backward_op(*output_grads, *(values[n] for n in positional),
                            **{n: v for n, v in values.items() if n not in positional})
        by_name = dict(zip(tensor_names, found if isinstance(found, tuple) else (found,)))
        # one per argument the call passed (the dispatcher leaves out trailing defaults)
        return tuple(by_name.get(n) if needed else None for n, needed in zip(positional, ctx.needs_input_grad))

    torch.library.register_autograd(name, gradients, setup_context=setup_context)


def _fresh_names(wanted: list[str], taken: set[str]) -> list[str]:
    names = []
    for name in wanted:
        while name in taken:
            name = "_" + name
        names.append(name)
    return names

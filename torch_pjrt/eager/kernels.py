"""PrivateUse1 kernels: transfers, allocation, views and the lowered ops.

Kernels are classified from each overload's schema: composite-implicit ops are left to
PyTorch (autograd keeps their decomposition); view ops reuse PyTorch's own CPU metadata
kernels; transfers, allocation and host reads are written here; every other op with a
lowering (written or decomposed) runs through `dispatch`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from torch_pjrt import _torch_private, native, storage
from torch_pjrt.eager import dispatch, dynamic, fusion
from torch_pjrt.ops import linalg
from torch_pjrt.runtime import client, startup

aten = torch.ops.aten
KEY = "PrivateUse1"


# --- host <-> device ---------------------------------------------------------------------------


def to_pjrt(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new pjrt tensor with a CPU tensor's contents (one transfer); dense layouts keep their strides.
    A tensor marked dynamic is padded to its buckets on the way (eager/dynamic.py)."""
    marks = dynamic.host_marks(tensor)
    source = tensor
    if dtype is not None and dtype != tensor.dtype:
        tensor = tensor.to(dtype)
    sizes, strides = tuple(tensor.shape), tuple(tensor.stride())
    order = storage.physical_order(sizes, strides)
    if marks:
        strides = storage.contiguous_strides(sizes)
        padded, layout = dynamic.pad_host(storage.host_array(tensor), sizes, marks)
        layout.array = client.to_device(padded, device.index)
        result = storage.new_tensor(layout, tensor.dtype, device, sizes, strides)
        dynamic.note_padded(storage.storage_of(result))
        _torch_private.copy_dynamo_marks(source, result)
        return result
    if order is None:
        strides, order = storage.contiguous_strides(sizes), tuple(range(len(sizes)))
    physical = storage.host_array(tensor if order == tuple(range(len(sizes))) else tensor.permute(order))
    return storage.new_tensor(client.to_device(physical, device.index), tensor.dtype, device, sizes, strides)


def to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A new CPU tensor with a pjrt tensor's contents (waits for it; a sync point in fused mode).
    A padded storage is cut to its true elements on the host, so no program runs per size."""
    fusion.flush("transfer to host")
    if tensor.numel() == 0 and storage.beyond_xla(tensor.shape):
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
    st = storage.storage_of(tensor)
    if isinstance(st.array, storage.Padded):
        flat = storage.host_tensor(st.array.host()).view(tensor.dtype)
        return torch.as_strided(flat, tensor.shape, tensor.stride(), tensor.storage_offset()).clone()
    return storage.host_tensor(dispatch.read_to_host(tensor)).view(tensor.dtype)  # byte dtypes come back as uint8


def resolve_device(device: Any) -> torch.device:
    """The pjrt device a device argument names, with its index (the current device's when it has none)."""
    if isinstance(device, torch.device) and device.type == "pjrt" and device.index is not None:
        return device  # (a pjrt tensor's own device, as factories between a model's steps pass it)
    device = torch.device(device)
    return torch.device("pjrt", startup.current_device() if device.index is None else device.index)


def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    if self.device.type == "pjrt" and src.device.type == "pjrt":
        if self.device != src.device:
            src = to_device_tensor(src, self.device)
        return _copy_on_device(self, src)
    if self.device.type == "pjrt":
        if src.dim() == 0 or tuple(src.shape) != tuple(self.shape):
            src = src.expand(self.shape)
        staged = to_pjrt(src.contiguous(), self.device, self.dtype)
        return _copy_on_device(self, staged)
    self.copy_(to_cpu(src))
    return self


def _copy_on_device(self: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    st = storage.storage_of(self)
    src_st = storage.storage_of(src)
    same_layout = (
        tuple(self.shape) == tuple(src.shape)
        and self.dtype == src.dtype
        and storage.view_of(self).covers(st.numel)
        and st.dtype == self.dtype
        and storage.view_of(src).covers(src_st.numel)
        and src_st.dtype == src.dtype
        and src_st.array is not None
        and not isinstance(src_st.array, storage.PendingArray)
    )
    if same_layout:
        # A copy, never the same array: an in-place op on either tensor donates its buffer.
        st.array = src_st.array.copy()
        return self
    return dispatch.execute(dispatch.plan_for(aten.copy_.default), (self, src), {})


def to_device_tensor(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    jax = client.jax_module()
    array = jax.device_put(dispatch.read(tensor), client.device_for(device.index))
    return storage.new_tensor(array.reshape(-1), tensor.dtype, device, tuple(tensor.shape))


def _to_copy(
    self: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    layout: Any = None,
    device: Any = None,
    pin_memory: bool | None = None,
    non_blocking: bool = False,
    memory_format: Any = None,
) -> torch.Tensor:
    dtype = dtype or self.dtype
    target = torch.device(device) if device is not None else self.device
    explicit_format = memory_format not in (None, torch.preserve_format)
    if target.type == "cpu":
        result = _laid_out_like(to_cpu(self), self, memory_format).to(dtype)
        return result.pin_memory() if pin_memory else result
    target = resolve_device(target)
    if self.device.type == "cpu":
        return to_pjrt(self.contiguous(memory_format=memory_format) if explicit_format else self, target, dtype)
    source = self if target == self.device else to_device_tensor(self, target)
    return dispatch.execute(
        dispatch.plan_for(aten._to_copy.default), (source,), {"dtype": dtype, "memory_format": memory_format}
    )


def _plain_to_copy(self: torch.Tensor, *, device: Any = None, pin_memory: bool | None = None, **_: Any) -> bool:
    """Whether `_to_copy` only converts on the tensor's own device (then it is `dispatch.execute`)."""
    return (self.device.type == "pjrt" and not pin_memory
            and (device is None or (torch.device(device).type == "pjrt" and resolve_device(device) == self.device)))


def _laid_out_like(copy: torch.Tensor, source: torch.Tensor, memory_format: Any) -> torch.Tensor:
    """A contiguous host copy of `source` given the strides PyTorch's copy would have: the asked
    memory format, else (preserve) the source's own when it is dense, as channels_last is."""
    if memory_format not in (None, torch.preserve_format):
        return copy.contiguous(memory_format=memory_format)
    sizes, strides = tuple(source.shape), tuple(source.stride())
    if source.is_contiguous() or storage.physical_order(sizes, strides) is None:
        return copy
    return torch.empty_strided(sizes, strides, dtype=copy.dtype).copy_(copy)


# --- allocation --------------------------------------------------------------------------------

_INT64_MAX = 2**63 - 1


def empty_memory_format(
    size: Any, *, dtype: Any = None, layout: Any = None, device: Any = None, pin_memory: Any = None,
    memory_format: Any = None,
) -> torch.Tensor:
    """An uninitialised storage, no program (Hugging Face's generate() makes one, empty, every token). Contiguous
    strides are computed here; another memory format, or a size past int64 in bytes, asks PyTorch's meta kernel
    (its strides, its overflow error)."""
    dtype = dtype or torch.get_default_dtype()
    sizes = tuple(map(int, size))
    if sizes and min(sizes) < 0:
        raise RuntimeError(f"Trying to create tensor with negative dimension {min(sizes)}: {list(sizes)}")
    storage.numpy_dtype(dtype)
    strides = storage.contiguous_strides(sizes)
    if (memory_format not in (None, torch.contiguous_format)
            or (sizes and strides[0] * max(sizes[0], 1) * dtype.itemsize > _INT64_MAX)):
        strides = tuple(torch.empty(sizes, dtype=dtype, device="meta", memory_format=memory_format).stride())
    return storage.new_tensor(None, dtype, resolve_device(device or "pjrt"), sizes, strides)


def empty_strided(
    size: Any, stride: Any, *, dtype: Any = None, layout: Any = None, device: Any = None, pin_memory: Any = None
) -> torch.Tensor:
    dtype = dtype or torch.get_default_dtype()
    storage.numpy_dtype(dtype)
    sizes, strides = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    return storage.new_tensor(None, dtype, resolve_device(device or "pjrt"), sizes, strides)


def resize_(self: torch.Tensor, size: Any, memory_format: Any = None) -> torch.Tensor:
    sizes = tuple(int(s) for s in size)
    if memory_format is not None and memory_format != torch.contiguous_format:
        strides = tuple(torch.empty(sizes, device="meta", memory_format=memory_format).stride())
    else:
        strides = storage.contiguous_strides(sizes)
    needed = self.storage_offset() + storage.storage_numel(sizes, strides, 0)
    st = storage.storage_of(self)
    if needed * self.dtype.itemsize <= st.nbytes:
        _torch_private.repoint(self, self.untyped_storage(), self.storage_offset(), sizes, strides)
        return self
    old = None if st.array is None or st.numel == 0 else storage.reinterpret(
        storage.flat_array(st.materialize()), st.dtype, self.dtype)
    fresh = storage.replace_storage(self, needed, sizes, strides)
    if old is not None:
        jnp = client.jax_module().numpy
        fresh.array = jnp.zeros((needed,), old.dtype).at[: min(old.shape[0], needed)].set(old[:needed])
    if self.storage_offset():
        _torch_private.repoint(self, self.untyped_storage(), 0, sizes, strides)
    return self


def resize_as_(self: torch.Tensor, the_template: torch.Tensor, memory_format: Any = None) -> torch.Tensor:
    """resize_ to the template's shape; preserve_format takes the template's memory format, as on CPU."""
    if memory_format == torch.preserve_format:
        memory_format = the_template.suggest_memory_format()
    return resize_(self, the_template.shape, memory_format)


def set_empty(self: torch.Tensor) -> torch.Tensor:
    storage.replace_storage(self, 0, (0,), (1,))
    return self


# --- reads to the host ----------------------------------------------------------------------------


def local_scalar_dense(self: torch.Tensor) -> Any:
    """The number, read as a numpy scalar where numpy holds the dtype (its item() is torch's Python number): the CPU
    tensor to_cpu would build around it costs more than the read itself."""
    fusion.flush("transfer to host")
    if self.dtype in storage.TORCH_TO_NUMPY and not isinstance(storage.storage_of(self).array, storage.Padded):
        return dispatch.read_to_host(self).item()
    return to_cpu(self).item()


def equal(self: torch.Tensor, other: torch.Tensor) -> bool:
    if self.shape != other.shape:
        return False
    return bool(torch.eq(self, other).all().item())


def native_batch_norm(
    input: torch.Tensor, weight: Any, bias: Any, running_mean: Any, running_var: Any, training: bool,
    momentum: float, eps: float,
) -> Any:
    """Route to the _native_batch_norm_legit family, whose schemas declare the running-stat updates."""
    if training and running_mean is not None:
        return aten._native_batch_norm_legit.default(input, weight, bias, running_mean, running_var, True,
                                                     momentum, eps)
    if running_mean is None:
        return aten._native_batch_norm_legit.no_stats(input, weight, bias, training, momentum, eps)
    return aten._native_batch_norm_legit_no_training.default(input, weight, bias, running_mean, running_var,
                                                             momentum, eps)


# SPECIAL kernels that, for the calls a predicate accepts, only run `dispatch.execute`: they take the native
# hit path like any lowered op, and a native miss the predicate refuses runs the kernel.
PLAIN_CALLS: dict[Any, Any] = {aten._to_copy.default: _plain_to_copy}

SPECIAL: dict[Any, Any] = {
    aten.native_batch_norm.default: native_batch_norm,
    aten.copy_.default: copy_,
    aten._copy_from.default: lambda self, dst, non_blocking=False: copy_(dst, self, non_blocking),
    aten._copy_from_and_resize.default: lambda self, dst: copy_(dst.resize_(self.shape), self),
    aten._to_copy.default: _to_copy,
    aten.empty.memory_format: empty_memory_format,
    aten.empty_strided.default: empty_strided,
    aten.resize_.default: resize_,
    aten.resize_as_.default: resize_as_,
    aten.set_.default: set_empty,
    aten._local_scalar_dense.default: local_scalar_dense,
    aten.equal.default: equal,
    aten._scaled_mm.default: linalg.scaled_mm,
}


# --- registration ----------------------------------------------------------------------------------

# Composite ops whose PrivateUse1 decomposition skips CPU's checks on values: our kernel replaces it.
COMPOSITE_REPLACED = frozenset({aten.one_hot.default})


def _is_view(op: torch._ops.OpOverload) -> bool:
    returns = op._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns) and not (
        op._schema.is_mutable
    )


def _metadata_kernel(op: torch._ops.OpOverload) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return _torch_private.redispatch_cpu(op, *args, **kwargs)

    return kernel


def _aten_overloads(names: list[str] | None) -> list[torch._ops.OpOverload]:
    """The aten overloads a kernel may be registered for: those with a CompositeImplicitAutograd kernel keep
    their decomposition (but COMPOSITE_REPLACED), checked by name before an overload object is built for them.
    `names`: those an earlier process of the same code and torch found (`KnownRegistration`), not searched again."""
    replaced = {op.name() for op in COMPOSITE_REPLACED}
    found = []
    for qualified in torch._C._dispatch_get_all_op_names() if names is None else names:
        if names is None and (not qualified.startswith("aten::") or (
                _torch_private.has_kernel(qualified, "CompositeImplicitAutograd") and qualified not in replaced)):
            continue
        name, _, overload = qualified[len("aten::"):].partition(".")
        packet = getattr(aten, name, None)
        if packet is None:
            continue
        try:
            found.append(getattr(packet, overload or "default"))
        except AttributeError:
            continue
    return found


class KnownRegistration(NamedTuple):
    """What registration reads from torch's dispatcher and schemas, the same in every process of the same code
    and torch: the device's start keeps it in the cache folder (torch_pjrt/_registration.py)."""

    overloads: list[str]
    schema_facts: dict[str, dispatch.SchemaFacts]


def register_all(known: KnownRegistration | None = None) -> tuple[list[torch.library.Library], KnownRegistration]:
    """Register a PrivateUse1 kernel for every aten overload we can run; with what an earlier process found
    (`known`), skip the search of torch's dispatcher and schemas. Also returns what this one found."""
    from torch_pjrt import ops  # noqa: F401 (fills the lowering table)
    from torch_pjrt.eager import data_dependent

    dispatch.schema_facts_known(None if known is None else known.schema_facts)
    overloads = _aten_overloads(None if known is None else known.overloads)
    special = {**SPECIAL, **data_dependent.KERNELS}
    plain_calls = {**PLAIN_CALLS, **data_dependent.PLAIN_CALLS}
    library = torch.library.Library("aten", "IMPL")
    native_dispatch = native.dispatch_module()
    if native_dispatch is not None:
        dispatch.configure_native(native_dispatch)
    for op in overloads:
        name = op.name()
        if op in plain_calls and native_dispatch is not None and dispatch.plan_for(op) is not None:
            dispatch.register_native(native_dispatch, op, dispatch.plan_for(op),
                                     unless_plain=(plain_calls[op], special[op]))
        elif op is aten.empty.memory_format and hasattr(native_dispatch, "register_empty"):
            native_dispatch.register_empty(empty_memory_format, client.unchecked_bytes)  # (the calls it answered)
        elif op in special:
            library.impl(op, special[op], KEY)
        elif _is_view(op) or op in METADATA_OPS:
            if _torch_private.has_kernel(name, "CompositeExplicitAutograd"):
                continue
            if native_dispatch is not None:
                native_dispatch.register_metadata_kernel(op._schema.name.split("::")[-1], op._schema.overload_name)
            else:
                library.impl(op, _metadata_kernel(op), KEY)
        else:
            plan = dispatch.plan_for(op)
            if plan is None:
                continue
            if native_dispatch is not None:
                dispatch.register_native(native_dispatch, op, plan)
            else:
                library.impl(op, dispatch.make_kernel(plan), KEY)
    # (a native module built before install_fused_attention leaves SDPA to the math route)
    if native_dispatch is not None and hasattr(native_dispatch, "install_fused_attention"):
        _install_fused_attention(native_dispatch)
    return [library], known or KnownRegistration([op.name() for op in overloads], dispatch.schema_facts_known())


def _install_fused_attention(native_dispatch: Any) -> None:
    """scaled_dot_product_attention on pjrt tensors as one op (ops/nn/attention.py, csrc/dispatch.cpp):
    its two torch_pjrt ops get native kernels, then the native module routes SDPA to them."""
    from torch_pjrt.ops.nn import attention

    for op in (attention.fused_attention_op, attention.fused_attention_backward_op):
        dispatch.register_native(native_dispatch, op, dispatch.plan_for(op))
    native_dispatch.install_fused_attention()


METADATA_OPS = frozenset(
    {
        aten.set_.source_Storage,
        aten.set_.source_Storage_storage_offset,
        aten.set_.source_Tensor,
        aten.as_strided_.default,
        # No alias annotation in its schema, yet CPU and CUDA return a view: kron(out=) writes through it.
        aten._unsafe_view.default,
    }
)


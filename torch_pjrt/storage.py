"""Device storages: a tensor is (storage, sizes, strides, offset) exactly as on CPU.

Each PyTorch storage of a pjrt tensor carries a `DeviceStorage` that owns one jax array of
its elements in storage order: 1-D, or shaped as the program that made it left it (its
dims in memory order), since flattening every program output costs XLA fusion and copies;
readers flatten it inside their programs for free. Views are PyTorch's own metadata over that storage, so
they alias like CUDA: reading a view is a slice/transpose (or, for odd strides, a
gather) of the flat array; writing a view is an update of the flat array.
The read and write functions here are pure jax and run inside jitted programs.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from torch_pjrt import _torch_private, native
from torch_pjrt.runtime import client, memory, metrics, programs

TORCH_TO_NUMPY: dict[torch.dtype, Any] = {
    torch.bool: np.bool_,
    torch.uint8: np.uint8,
    torch.uint16: np.uint16,
    torch.uint32: np.uint32,
    torch.uint64: np.uint64,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}


# Dtypes numpy lacks, held through ml_dtypes under the same names: bfloat16 and the float8 formats
# (float8_e8m0fnu is the exponent-only scale format of MX blocks).
ML_DTYPES: tuple[torch.dtype, ...] = (
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
)
FLOAT8_DTYPES: tuple[torch.dtype, ...] = tuple(d for d in ML_DTYPES if d.itemsize == 1)
# Dtypes held as their raw bytes (uint8): PyTorch's pair of fp4 e2m1 values packed in a byte (MX fp4) has no jax
# dtype (ml_dtypes' float4_e2m1fn is one value per element, and XLA packs it itself). CPU only moves, compares
# and selects these bytes; every other op refuses them, on pjrt as on CPU (ops/arguments.py).
BYTE_DTYPES: tuple[torch.dtype, ...] = (torch.float4_e2m1fn_x2,)
# Dtypes whose few CPU kernels pjrt follows by trying the op on CPU stand-ins first.
NARROW_DTYPES: tuple[torch.dtype, ...] = FLOAT8_DTYPES + BYTE_DTYPES
# The same-size integer dtype whose bits carry an ml_dtypes value between torch and numpy.
_CARRIER = {1: torch.uint8, 2: torch.int16}


class UnsupportedDtype(TypeError, NotImplementedError):
    """A dtype pjrt tensors cannot hold (complex32, the 4-bit and 6-bit floats, ...): a TypeError for a bad
    argument, and a NotImplementedError like everything else the device does not do."""


def numpy_dtype(dtype: torch.dtype) -> Any:
    """The numpy/jax dtype holding a torch dtype's elements (bfloat16 and float8 through ml_dtypes)."""
    if dtype in TORCH_TO_NUMPY:
        return np.dtype(TORCH_TO_NUMPY[dtype])
    if dtype in BYTE_DTYPES:
        return np.dtype(np.uint8)
    if dtype in ML_DTYPES:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, str(dtype).removeprefix("torch.")))
    raise UnsupportedDtype(
        f"pjrt tensors cannot hold {dtype}; use one of "
        + ", ".join(str(d) for d in [*TORCH_TO_NUMPY, *ML_DTYPES, *BYTE_DTYPES])
        + "."
    )


def torch_dtype(dtype: Any) -> torch.dtype:
    """The torch dtype of a numpy dtype (looked up once per dtype: each read to the host asks, e.g. per `.item()`)."""
    return _torch_dtype_of(np.dtype(dtype))


@functools.cache
def _torch_dtype_of(dtype: np.dtype) -> torch.dtype:
    for key in ML_DTYPES:
        if dtype.name == str(key).removeprefix("torch."):
            return key
    for key, value in TORCH_TO_NUMPY.items():
        if np.dtype(value) == dtype:
            return key
    raise TypeError(f"no torch dtype for {dtype}")


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A private numpy copy of a CPU tensor's logical contents (bfloat16 and float8 through ml_dtypes).

    A copy, never a view: jax reads host buffers asynchronously (a transfer, a program's host
    argument), after the caller may already have written to the tensor again.
    """
    held = numpy_dtype(tensor.dtype)  # raises UnsupportedDtype first for a dtype no pjrt tensor holds
    if (tensor.is_contiguous() and tensor.dtype not in ML_DTYPES and tensor.dtype not in BYTE_DTYPES
            and not (tensor.requires_grad or tensor.is_conj() or tensor.is_neg())):
        # one dispatcher op, not four: a batch's transfer after a host wait met each of them cold (a training
        # step's first .to("pjrt"), 8x64 int64). The numpy view is of our clone: numpy() on the caller's own
        # tensor would leave its storage unresizable for good (an out= tensor, resize_)
        return tensor.clone().numpy()
    tensor = tensor.detach().resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
    if tensor.dtype in ML_DTYPES or tensor.dtype in BYTE_DTYPES:
        return tensor.view(_CARRIER[tensor.dtype.itemsize]).numpy().view(held)
    return tensor.numpy()


def host_tensor(array: np.ndarray) -> torch.Tensor:
    """A CPU tensor with its own copy of a host array's contents."""
    dtype = torch_dtype(array.dtype)
    if dtype in ML_DTYPES:
        carrier = _CARRIER[dtype.itemsize]
        return torch.from_numpy(np.array(array, copy=True).view(TORCH_TO_NUMPY[carrier])).view(dtype)
    return torch.from_numpy(np.array(array, copy=True))


# --- memory accounting and fake addresses ------------------------------------------------

_ADDRESS_BASE = 1 << 52
_ALIGN = 64
_address_lock = threading.Lock()
_next_address = [_ADDRESS_BASE]


def _new_address(nbytes: int) -> int:
    """A fresh fake address; the native allocator's when the module is built (native kernels make
    storages too, and both must never hand out the same address)."""
    address = native.new_address(nbytes)
    if address is not None:
        return address
    with _address_lock:
        address = _next_address[0]
        _next_address[0] += max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
    return address


class PendingArray:
    """An array that a deferred (fused) program will produce; `resolve()` runs it."""

    __slots__ = ()

    def resolve(self) -> Any:
        raise NotImplementedError


class Padded(PendingArray):
    """A storage's elements held at bucket sizes (bounded dynamism, eager/dynamic.py).

    `array` (a device array or a fused result) has shape `padded`; the storage's true elements
    are the row-major array of shape `shape` in its leading box, garbage after it. `bounds[i]` is
    the upper bound that buckets dim i (0: powers of two, unbounded), None for an exact dim. Code
    that knows the layout reads `array`; everything else resolves it to the plain flat elements
    (one program per true shape).
    """

    __slots__ = ("array", "shape", "padded", "bounds")

    def __init__(self, array: Any, shape: tuple[int, ...], padded: tuple[int, ...],
                 bounds: tuple[int | None, ...]) -> None:
        self.array = array
        self.shape = shape
        self.padded = padded
        self.bounds = bounds

    def holding(self, array: Any) -> Padded:
        """The same layout over a new array (an in-place update of the storage)."""
        return Padded(array, self.shape, self.padded, self.bounds)

    def bucket_array(self) -> Any:
        """The bucket-size device array (a fused result is run for it first)."""
        return self.array.resolve() if isinstance(self.array, PendingArray) else self.array

    def resolve(self) -> Any:
        metrics.bump("dynamic_compactions")
        return compactor(self.shape, self.padded)[1].call(self.bucket_array())

    def host(self) -> np.ndarray:
        """The true elements on the host, flat (the padding is cut off there: no program per size)."""
        box = tuple(slice(0, n) for n in self.shape)
        return np.asarray(client.to_host(self.bucket_array())).reshape(self.padded)[box].reshape(-1)


class Consumed(PendingArray):
    """A storage whose buffer an op took (a custom op's donate_argnums): reading it raises."""

    __slots__ = ("op",)

    def __init__(self, op: str) -> None:
        self.op = op

    def resolve(self) -> Any:
        raise RuntimeError(f"this pjrt tensor was donated to {self.op} (donate_argnums), which took its buffer; "
                           f"pass a clone() to the op if you read the tensor afterwards.")


_compactors: dict[tuple, tuple[Any, Any]] = {}


def compactor(shape: tuple[int, ...], padded: tuple[int, ...]) -> tuple[Any, Any]:
    """The function, and its program, that cut a padded array down to its true elements, flat."""
    found = _compactors.get((shape, padded))
    if found is None:
        box = tuple(slice(0, n) for n in shape)

        def compact(array: Any) -> Any:
            return array.reshape(padded)[box].reshape(-1)

        found = _compactors[(shape, padded)] = (compact, programs.Program(compact, "compact_padded"))
    return found


class DeviceStorage:
    """The device side of one PyTorch storage: a flat jax array, or None while uninitialised.

    Plain data: the native dispatch makes these without calling Python code, and the PyTorch
    storage counts its own bytes (csrc/hooks.cpp); `CountedDeviceStorage` counts them where the
    native module is not built."""

    __slots__ = ("array", "dtype", "numel", "device", "nbytes", "__weakref__")

    def __init__(self, array: Any, dtype: torch.dtype, numel: int, device: torch.device) -> None:
        self.array = array
        self.dtype = dtype
        self.numel = numel
        self.device = device
        self.nbytes = numel * dtype.itemsize

    def materialize(self) -> Any:
        """The flat array; an uninitialised storage (torch.empty) reads as zeros."""
        if isinstance(self.array, PendingArray):
            self.array = self.array.resolve()
        if self.array is None:
            jax = client.jax_module()
            with client.out_of_memory_translated((), self.device.index):
                zeros = np.zeros(self.numel, numpy_dtype(self.dtype))
                self.array = jax.device_put(zeros, client.device_for(self.device.index))
        return self.array

    def resize(self, nbytes: int) -> None:
        """Follow the PyTorch storage's resize to nbytes (`untyped_storage().resize_`, as FSDP2 frees and
        re-allocates its unsharded parameters). As on CUDA, the elements that still fit are kept and the
        rest are uninitialised; at 0 bytes the device array is dropped (a pending fused value with it, so
        the fused program no longer computes it). A size that is not a whole number of elements holds
        the partial last element too."""
        numel = -(-nbytes // self.dtype.itemsize)
        if numel > self.numel:
            client.check_fits(self.device.index, (numel - self.numel) * self.dtype.itemsize)
        array = None
        if self.array is not None and min(numel, self.numel) > 0:
            flat = flat_array(self.materialize())
            if numel <= self.numel:
                array = flat[:numel]
            else:
                jnp = client.jax_module().numpy
                with client.out_of_memory_translated((), self.device.index):
                    array = jnp.concatenate([flat, jnp.zeros(numel - self.numel, flat.dtype)])
        self.array = array
        self.numel = numel
        self.nbytes = numel * self.dtype.itemsize


class CountedDeviceStorage(DeviceStorage):
    """A DeviceStorage that counts its bytes in the device's memory figures itself (no native module)."""

    __slots__ = ()

    def __init__(self, array: Any, dtype: torch.dtype, numel: int, device: torch.device) -> None:
        super().__init__(array, dtype, numel, device)
        memory.stats.add(device.index, self.nbytes)

    def __del__(self) -> None:
        memory.stats.add(self.device.index, -self.nbytes)

    def resize(self, nbytes: int) -> None:
        before = self.nbytes
        super().resize(nbytes)
        memory.stats.add(self.device.index, self.nbytes - before)


def resize_device_storage(st: DeviceStorage, nbytes: int) -> None:
    """The native resize hook's call (csrc/storage_link.cpp), before it resizes the PyTorch storage."""
    st.resize(nbytes)


def _resize_without_native(untyped: Any, nbytes: int) -> None:
    """`resize_` of a pjrt storage where torch_pjrt._hooks is not built: PyTorch's Python hooks cannot
    resize a PrivateUse1 storage, so the storage's bytes are swapped for a new storage's (the same
    fake address while it fits the span reserved there, a new one beyond it)."""
    if nbytes < 0:
        raise RuntimeError(f"cannot resize a pjrt storage to {nbytes} bytes")
    try:
        st = untyped._pjrt
    except AttributeError:
        raise RuntimeError("this pjrt storage was not made by torch_pjrt, so it cannot be resized.") from None
    st.resize(nbytes)
    device, address, before = untyped.device, untyped.data_ptr(), untyped.nbytes()
    if nbytes > 0 and (address == 0 or nbytes > max(_ALIGN, -(-before // _ALIGN) * _ALIGN)):
        address = _new_address(nbytes)
    # _swap_data_ptr_ swaps two storages' bytes where one of them holds none.
    untyped._swap_data_ptr_(_torch_private.new_storage(0, device, 0))
    if nbytes > 0:
        untyped._swap_data_ptr_(_torch_private.new_storage(address, device, nbytes))


def _install_resize_without_native() -> None:
    """Route pjrt storages' `UntypedStorage.resize_` to `_resize_without_native` (idempotent). Only
    where the native module is not built: its hooks resize the storage themselves."""
    original = torch.UntypedStorage.resize_
    if getattr(original, "_pjrt_resize", False):
        return

    def resize_(self: Any, size: int) -> Any:
        if self.device.type != "pjrt":
            return original(self, size)
        _resize_without_native(self, int(size))
        return self

    resize_._pjrt_resize = True  # type: ignore[attr-defined]
    resize_.__doc__ = original.__doc__
    torch.UntypedStorage.resize_ = resize_


def _install_clone() -> None:
    """Without the native module: route pjrt storages' `UntypedStorage.clone` (and so `copy.deepcopy` of a pjrt
    tensor) through a tensor clone. PyTorch's own allocates `UntypedStorage(nbytes, device=...)`, which needs the
    device's C++ allocator (csrc/hooks.cpp) and crashes the process without one."""
    original = torch.UntypedStorage.clone
    if getattr(original, "_pjrt_clone", False):
        return

    def clone(self: Any) -> Any:
        if self.device.type != "pjrt":
            return original(self)
        held = self._pjrt
        whole = torch.empty(0, dtype=held.dtype, device=self.device).set_(self, 0, (held.numel,), (1,))
        return whole.clone().untyped_storage()

    clone._pjrt_clone = True  # type: ignore[attr-defined]
    clone.__doc__ = original.__doc__
    torch.UntypedStorage.clone = clone


def _storage_class() -> type[DeviceStorage]:
    return DeviceStorage if native.counting_module() is not None else CountedDeviceStorage


def uninitialised_bytes(nbytes: int, index: int) -> DeviceStorage:
    """The device storage of a storage PyTorch allocated itself (`torch.UntypedStorage(n, device="pjrt")`):
    its bytes, uninitialised (read as zeros) until written."""
    return _storage_class()(None, torch.uint8, nbytes, torch.device("pjrt", index))


def storage_of(tensor: torch.Tensor) -> DeviceStorage:
    client.refuse_in_forked_child()
    try:
        return tensor.untyped_storage()._pjrt
    except AttributeError:
        raise RuntimeError(
            f"this {tensor.device} tensor has no device storage (it was not made by torch_pjrt)."
        ) from None


def new_tensor(
    array: Any,
    dtype: torch.dtype,
    device: torch.device,
    sizes: Sequence[int],
    strides: Sequence[int] | None = None,
    numel: int | None = None,
) -> torch.Tensor:
    """Wrap a flat device array (or None: uninitialised) as a tensor with the given layout."""
    if strides is None:
        strides = contiguous_strides(sizes)
    if numel is None:
        numel = storage_numel(sizes, strides, 0)
    nbytes = numel * dtype.itemsize
    if array is None:
        client.check_fits(device.index, nbytes)
    make = native.tensor_factory()
    if make is not None:
        tensor = make(device.index, dtype, sizes, strides, _new_address(nbytes), nbytes)
        storage = tensor.untyped_storage()
    else:
        tensor, storage = _torch_private.new_tensor(device, dtype, sizes, strides, 0, _new_address(nbytes), nbytes)
    storage._pjrt = _storage_class()(array, dtype, numel, device)
    return tensor


def replace_storage(tensor: torch.Tensor, numel: int, sizes: Sequence[int], strides: Sequence[int]) -> DeviceStorage:
    """Point a tensor at a new, larger storage (resize_), keeping nothing of the old one."""
    device = tensor.device
    nbytes = numel * tensor.dtype.itemsize
    client.check_fits(device.index, nbytes)
    module = native.counting_module()
    if module is not None:
        storage = module.new_storage(device.index, _new_address(nbytes), nbytes)
    else:
        storage = _torch_private.new_storage(_new_address(nbytes), device, nbytes)
    storage._pjrt = _storage_class()(None, tensor.dtype, numel, device)
    _torch_private.repoint(tensor, storage, 0, sizes, strides)
    return storage._pjrt


# XLA aborts the process on an array with a dimension this large, even an empty one (CPU allows it)
XLA_DIMENSION_LIMIT = 2**61


def beyond_xla(sizes: Sequence[int]) -> bool:
    """Whether XLA cannot hold an array of these sizes (it would abort the process, not raise)."""
    return any(n >= XLA_DIMENSION_LIMIT for n in sizes)


def contiguous_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    strides = []
    running = 1
    for size in reversed(sizes):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def storage_numel(sizes: Sequence[int], strides: Sequence[int], offset: int) -> int:
    """Elements a storage needs to hold this view (0 for an empty view)."""
    if any(s == 0 for s in sizes):
        return 0
    return offset + 1 + sum((s - 1) * st for s, st in zip(sizes, strides))


# --- views as pure jax -------------------------------------------------------------------


class View(NamedTuple):
    """How a tensor sits in its storage; part of every program's cache key."""

    dtype: torch.dtype
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    # PyTorch's lazy conjugate and negative bits (complex views): applied when read or written.
    conj: bool = False
    neg: bool = False

    def covers(self, storage_numel_: int) -> bool:
        """True when the view is the whole storage in row-major order (zero-copy case)."""
        return (
            not self.conj
            and not self.neg
            and self.offset == 0
            and math.prod(self.sizes) == storage_numel_
            and self.strides == contiguous_strides(self.sizes)
        )

    def has_internal_overlap(self) -> bool:
        """Two elements at one address (an expanded view); never for an empty view, as on CPU."""
        return 0 not in self.sizes and any(st == 0 and s > 1 for s, st in zip(self.sizes, self.strides))


def view_of(tensor: torch.Tensor) -> View:
    if tensor.is_complex():
        return View(tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(),
                    tensor.is_conj(), tensor.is_neg())
    return View(tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())


def _apply_bits(value: Any, view: View) -> Any:
    if view.conj:
        value = value.conj()
    return -value if view.neg else value


def reinterpret(flat: Any, source: torch.dtype, target: torch.dtype) -> Any:
    """Reinterpret the bytes of a flat array as another dtype (tensor.view(dtype), view_as_real)."""
    if source == target:
        return flat
    jnp = client.jax_module().numpy
    lax = client.jax_module().lax
    if source.is_complex and target == source.to_real():
        return jnp.stack([flat.real, flat.imag], axis=-1).reshape(-1)
    if target.is_complex and source == target.to_real():
        numpy_dtype(target)  # raises UnsupportedDtype for complex32 (float16 pairs), which XLA cannot hold
        pairs = flat.reshape(-1, 2)
        return lax.complex(pairs[:, 0], pairs[:, 1])
    if source == torch.bool:
        return reinterpret(flat.astype(np.uint8), torch.uint8, target)
    if target == torch.bool:
        return reinterpret(flat, source, torch.uint8).astype(np.bool_)
    if source.is_complex or target.is_complex:
        raise NotImplementedError(f"pjrt cannot reinterpret {source} storage as {target}.")
    out_np = numpy_dtype(target)
    if source.itemsize == target.itemsize:
        return lax.bitcast_convert_type(flat, out_np)
    if source.itemsize > target.itemsize:
        return lax.bitcast_convert_type(flat, out_np).reshape(-1)
    ratio = target.itemsize // source.itemsize
    return lax.bitcast_convert_type(flat.reshape(-1, ratio), out_np)


def _core_dims(view: View) -> list[int]:
    """Dims that move through memory: size > 1 and a non-zero stride, by stride, outermost first."""
    dims = [d for d, (s, st) in enumerate(zip(view.sizes, view.strides)) if s > 1 and st != 0]
    return sorted(dims, key=lambda d: -view.strides[d])


def _dense_plan(view: View) -> tuple[list[int], tuple[int, ...], int] | None:
    """If the view is a strided box of a dense block, the block's shape and length."""
    dims = _core_dims(view)
    if not dims:
        return dims, (), 1
    strides = [view.strides[d] for d in dims]
    sizes = [view.sizes[d] for d in dims]
    if any(st < 0 for st in strides):
        return None
    base = [sizes[0]]
    for outer, inner, size in zip(strides, strides[1:], sizes[1:]):
        if outer % inner or size * inner > outer:
            return None
        base.append(outer // inner)
    base.append(strides[-1])
    return dims, tuple(base), sizes[0] * strides[0]


def _gather_indices(view: View, dims: list[int]) -> Any:
    jnp = client.jax_module().numpy
    lax = client.jax_module().lax
    shape = tuple(view.sizes[d] for d in dims)
    index = jnp.full(shape, view.offset, dtype=np.int64)
    for axis, d in enumerate(dims):
        index = index + lax.broadcasted_iota(np.int64, shape, axis) * view.strides[d]
    return index


def positions(view: View) -> Any:
    """The storage index of each of the view's elements (traced iota arithmetic, which XLA fuses into the
    gather or scatter that uses it)."""
    lax = client.jax_module().lax
    index = lax.full(view.sizes, view.offset, np.int64)
    for axis, stride in enumerate(view.strides):
        if stride and view.sizes[axis] > 1:
            index = index + lax.broadcasted_iota(np.int64, view.sizes, axis) * stride
    return index


def _block(flat: Any, offset: int, length: int) -> Any:
    jnp = client.jax_module().numpy
    end = offset + length
    if end > flat.shape[0]:
        flat = jnp.pad(flat, (0, end - flat.shape[0]))
    return flat[offset:end]


def flat_array(array: Any) -> Any:
    """A storage's array as 1-D (storages may hold their elements shaped, in row-major order)."""
    return array if array.ndim == 1 else array.reshape(-1)


def read_view(flat: Any, storage_dtype: torch.dtype, view: View) -> Any:
    """The logical array a view shows (jax, traced)."""
    jnp = client.jax_module().numpy
    flat = reinterpret(flat_array(flat), storage_dtype, view.dtype)
    if math.prod(view.sizes) == 0:
        return jnp.zeros(view.sizes, flat.dtype)
    plan = _dense_plan(view)
    if plan is not None:
        dims, base, length = plan
        if not dims:
            core = flat[view.offset]
        else:
            block = _block(flat, view.offset, length).reshape(base)
            index = (slice(None),) + tuple(slice(0, view.sizes[d]) for d in dims[1:]) + (0,)
            core = block[index]
    else:
        dims = _core_dims(view)
        core = flat[_gather_indices(view, dims)]
    order = sorted(range(len(dims)), key=lambda i: dims[i])
    core = jnp.transpose(core, order) if dims else core
    kept = tuple(view.sizes[d] if d in dims else 1 for d in range(len(view.sizes)))
    return _apply_bits(jnp.broadcast_to(core.reshape(kept), view.sizes), view)


def write_view(flat: Any, storage_dtype: torch.dtype, view: View, value: Any) -> Any:
    """The storage's array after writing `value` (broadcast to the view) through the view; it keeps
    the array's shape, so a storage updated every step keeps its programs (and donates its buffer)."""
    jnp = client.jax_module().numpy
    value = _apply_bits(jnp.broadcast_to(value.astype(numpy_dtype(view.dtype)), view.sizes), view)
    if view.covers(flat.size) and view.dtype == storage_dtype:
        return value.reshape(flat.shape)
    if math.prod(view.sizes) == 0:
        return flat
    shape, flat = flat.shape, flat_array(flat)
    typed = reinterpret(flat, storage_dtype, view.dtype)
    dims = _core_dims(view)
    index_of_first = tuple(0 if d not in dims else slice(None) for d in range(len(view.sizes)))
    core = jnp.transpose(value[index_of_first], [sorted(dims).index(d) for d in dims]) if dims else value[
        tuple(0 for _ in view.sizes)
    ]
    plan = _dense_plan(view)
    if plan is not None and dims:
        _, base, length = plan
        end = view.offset + length
        padded = typed if end <= typed.shape[0] else jnp.pad(typed, (0, end - typed.shape[0]))
        block = padded[view.offset:end].reshape(base)
        index = (slice(None),) + tuple(slice(0, view.sizes[d]) for d in dims[1:]) + (0,)
        block = block.at[index].set(core)
        updated = padded.at[view.offset:end].set(block.reshape(-1))[: typed.shape[0]]
    else:
        updated = typed.at[_gather_indices(view, dims)].set(core)
    return reinterpret(updated, view.dtype, storage_dtype).reshape(shape)


def physical_order(sizes: Sequence[int], strides: Sequence[int]) -> tuple[int, ...] | None:
    """The dim order that makes a dense non-overlapping layout row-major, if it is one."""
    order = sorted(range(len(sizes)), key=lambda d: (-strides[d], -sizes[d]))
    running = 1
    for d in reversed(order):
        if sizes[d] != 1 and strides[d] != running:
            return None
        running *= sizes[d]
    return tuple(order)


def strides_in_order(sizes: Sequence[int], order: Sequence[int]) -> tuple[int, ...]:
    """Dense strides that lay dims out in `order` (outermost first)."""
    strides = [0] * len(sizes)
    running = 1
    for d in reversed(order):
        strides[d] = running
        running *= max(sizes[d], 1)
    return tuple(strides)


def pack(value: Any, sizes: Sequence[int], strides: Sequence[int]) -> Any:
    """Lay a logical array out as the storage of a dense layout with these strides: its dims in
    memory order, left shaped (flattening at a program's output costs XLA fusion and copies)."""
    jnp = client.jax_module().numpy
    order = physical_order(sizes, strides)
    if order is None:
        return jnp.reshape(value, (-1,))
    if order == tuple(range(len(sizes))):
        return jnp.asarray(value)
    return jnp.transpose(value, order)


def is_dense(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    return physical_order(sizes, strides) is not None


def iter_tensors(values: Any) -> Any:
    """Every tensor in a (possibly nested list/tuple) argument structure."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from iter_tensors(value)



if native.counting_module() is None:
    _install_resize_without_native()
    _install_clone()

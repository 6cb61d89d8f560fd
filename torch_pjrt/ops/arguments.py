"""CPU's argument checks that PyTorch's meta kernels skip, or make with another exception class.

The eager dispatcher calls `check(op, arguments)` before it runs an op's meta kernel on a cache miss,
with every tensor argument as a meta tensor: these checks read only shapes, dtypes and static
arguments, so a program that passed them once passes them for every call it serves. Each raises
CPU's exception class with CPU's message, in CPU's order. Checks on values are device-side checks,
made by the lowerings (runtime/checks.py). META_KERNELS replaces the meta kernels whose result
dtype is not CPU's.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._ops import OpOverload

from torch_pjrt import storage
from torch_pjrt.ops.factories import scalar_type_name

# overload packet name (in-place and out= variants share it) -> its checks
_CHECKS: dict[str, Callable[..., None]] = {}


def _checks(*names: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    def decorate(fn: Callable[..., None]) -> Callable[..., None]:
        for name in names:
            _CHECKS[name] = fn
        return fn

    return decorate


def check(op: OpOverload, arguments: dict[str, Any]) -> None:
    """Raise what CPU raises for these arguments of `op` (tensors given as meta tensors)."""
    name = op._schema.name.split("::")[-1].removesuffix("_")
    found = _CHECKS.get(name)
    if found is not None:
        found(name, **arguments)
    refuse_float8_like_cpu(op, arguments)


def _holds_float8(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype in storage.NARROW_DTYPES
    if isinstance(value, torch.dtype):
        return value in storage.BYTE_DTYPES  # CPU casts to float8 but never to a byte dtype
    return isinstance(value, (list, tuple)) and any(_holds_float8(v) for v in value)


def _small_zeros(value: Any) -> Any:
    """A CPU stand-in for a tensor argument: zeros of its dtype, each dimension cut to at most 2."""
    if isinstance(value, torch.Tensor):
        return torch.zeros([min(size, 2) for size in value.shape], dtype=value.dtype)
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return [None if v is None else _small_zeros(v) for v in value]
    if isinstance(value, torch.device):
        return torch.device("cpu")
    return value


def refuse_float8_like_cpu(op: OpOverload, arguments: dict[str, Any]) -> None:
    """CPU's NotImplementedError for an op on float8 tensors that CPU has no float8 kernel for.

    CPU runs few ops on float8 (copies, indexing, `cat`, `where`, `mul`, `mm`, `abs`, `==`, ...), and
    which ones, with which message, is its kernels' business: the op runs once on small CPU zeros of
    the same dtypes (CPU's random state kept) and its float8 refusal, if any, is raised here. Ops that
    take a size (factories) are not tried for float8: they fill, which CPU does for float8, and a size is not
    cut; for a byte dtype, which CPU fills with nothing but zeros, they are tried with every size 1.
    Other failures of the stand-ins (a size argument no longer fitting) say nothing and are ignored.
    """
    if op.namespace != "aten" or not any(_holds_float8(v) for v in arguments.values()):
        return
    if any(argument.name == "size" for argument in op._schema.arguments):
        if not isinstance(arguments.get("size"), (list, tuple)) or not any(
                isinstance(v, torch.dtype) and v in storage.BYTE_DTYPES for v in arguments.values()):
            return
        arguments = {**arguments, "size": [1] * len(arguments["size"])}
    # type(value) is object: a keyword-only argument the caller left at its default
    stand_ins = {name: _small_zeros(value) for name, value in arguments.items() if type(value) is not object}
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.simplefilter("ignore")
        try:
            op(**stand_ins)
        except NotImplementedError as error:
            if "not implemented for 'Float8" in str(error) or "not implemented for 'Float4" in str(error):
                raise NotImplementedError(str(error)) from None
        except Exception:  # noqa: BLE001, S110  (a stand-in that does not fit says nothing about float8)
            pass


def _sizes(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def _wrap(dim: int, ndim: int) -> int:
    """CPU's dim wrapping (a 0-d tensor has one dim), IndexError out of range."""
    rank = max(ndim, 1)
    if not -rank <= dim < rank:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-rank}, {rank - 1}], but got {dim})")
    return dim % rank


# caffe2's names of dtypes, as CPU's structured out= check spells them
_TYPE_META_NAMES = {
    torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16",
    torch.int64: "long int", torch.int32: "int", torch.int16: "short int", torch.int8: "signed char",
    torch.uint8: "unsigned char", torch.bool: "bool", torch.complex64: "c10::complex<float>",
    torch.complex128: "c10::complex<double>",
}


def _out_dtype(out: torch.Tensor | None, expected: torch.dtype) -> None:
    """A structured kernel's out= must have the result's dtype exactly (no cast)."""
    if out is not None and out.dtype != expected:
        raise RuntimeError(f"Expected out tensor to have dtype {_TYPE_META_NAMES.get(expected, expected)}, but got "
                           f"{_TYPE_META_NAMES.get(out.dtype, out.dtype)} instead")


# --- index_* along one dim ---------------------------------------------------------------------


def _shape_but(t: torch.Tensor, dim: int) -> list[int]:
    sizes = _sizes(t)
    return sizes[:dim] + sizes[dim + 1:] if sizes else sizes


@_checks("add", "sub", "rsub")
def _alpha(name: str, /, self: Any, other: Any, alpha: Any = 1, **_: Any) -> None:
    """CPU's checks: no bool operand of a subtraction, and `alpha` against the result's dtype (the
    reference kernels raise a ValueError of their own, or nothing)."""
    if name != "add":
        bools = [v.dtype == torch.bool if isinstance(v, torch.Tensor) else isinstance(v, bool) for v in (self, other)]
        if all(bools):
            raise RuntimeError("Subtraction, the `-` operator, with two bool tensors is not supported. "
                               "Use the `^` or `logical_xor()` operator instead.")
        if any(bools):
            raise RuntimeError("Subtraction, the `-` operator, with a bool tensor is not supported. "
                               "If you are trying to invert a mask, use the `~` or `logical_not()` operator instead.")
    if type(alpha) is object:  # left at its default
        return
    dtype = torch.result_type(self, other)
    if isinstance(alpha, bool) and dtype != torch.bool:
        raise RuntimeError("Boolean alpha only supported for Boolean results.")
    if isinstance(alpha, float) and not (dtype.is_floating_point or dtype.is_complex):
        raise RuntimeError("For integral input tensors, argument alpha must not be a floating point number.")
    if isinstance(alpha, complex) and not dtype.is_complex:
        raise RuntimeError("For non-complex input tensors, argument alpha must not be a complex number.")


@_checks("index_add", "index_reduce")
def _index_add(name: str, /, self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, **_: Any) -> None:
    dim = _wrap(dim, self.dim())
    if index.dim() > 1:
        raise IndexError(f"{name}_(): Index is supposed to be a vector, but got dim: {index.dim()} with type: "
                         f"{scalar_type_name(index.dtype)} and size: {_sizes(index)}")
    if index.dtype not in (torch.int64, torch.int32):
        raise RuntimeError(f"{name}_(): Expected dtype int32/int64 for index but got: {scalar_type_name(index.dtype)}")
    if self.dtype != source.dtype:
        raise RuntimeError(f"{name}_(): self ({scalar_type_name(self.dtype)}) and source "
                           f"({scalar_type_name(source.dtype)}) must have the same scalar type")
    if dim != 0 and dim >= source.dim():
        raise RuntimeError(f"{name}_(): Indexing dim {dim} is out of bounds of the source tensor with dim "
                           f"{source.dim()}")
    count = 1 if source.dim() == 0 else source.shape[dim]
    if index.numel() != count:
        raise RuntimeError(f"{name}_(): Number of indices ({index.numel()}) should be equal to source.size(dim): "
                           f"({count}), for dim: {dim}")
    both = self.dim() and source.dim()
    if (_shape_but(self, dim) if both else _sizes(self)) != (_shape_but(source, dim) if both else _sizes(source)):
        raise RuntimeError("source tensor shape must match self tensor shape, excluding the specified dimension. "
                           f"Got self.shape = {_sizes(self)} source.shape = {_sizes(source)}")


@_checks("index_copy")
def _index_copy(_name: str, /, self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor,
                **_: Any) -> None:
    dim = _wrap(dim, self.dim())
    if index.dim() > 1:
        raise IndexError(f"index_copy_(): Index should have dimension 1 or 0 (got {index.dim()})")
    if source.dim() == 0 and index.numel() != 1:
        raise IndexError(f"index_copy_(): When source is scalar, index should have one element (got {index.numel()})")
    if source.dim() != self.dim() and source.dim() and self.dim():
        raise IndexError("index_copy_(): When source and destination are not scalars, their dimensionality must "
                         f"match. Source dimensionality ({source.dim()}), destination dimensionality ({self.dim()})")
    if index.dtype != torch.int64:
        raise RuntimeError(f"index_copy_(): Expected a long tensor for index, but got {scalar_type_name(index.dtype)}")
    if self.dtype != source.dtype:
        raise RuntimeError("index_copy_(): self and source expected to have the same dtype, but got (self) "
                           f"{scalar_type_name(self.dtype)} and (source) {scalar_type_name(source.dtype)}")
    if _shape_but(self, dim) != _shape_but(source, dim):
        raise RuntimeError("index_copy_(): Source/destination tensor must have same slice shapes. Destination slice "
                           f"shape: {_slice_text(self, dim)} at dimension {dim} and source slice shape: "
                           f"{_slice_text(source, dim)} at dimension 0.")
    if source.dim() and index.numel() != source.shape[dim]:
        raise IndexError(f"index_copy_(): Number of indices ({index.numel()}) should be equal to source.size(dim) "
                         f"({source.shape[dim]})")


def _slice_text(t: torch.Tensor, dim: int) -> str:
    return ", ".join(str(n) for n in _shape_but(t, dim))


@_checks("index_fill")
def _index_fill(_name: str, /, self: torch.Tensor, dim: int, index: torch.Tensor, **_: Any) -> None:
    _wrap(dim, self.dim())
    if index.dtype != torch.int64:
        raise IndexError("index_fill_(): Expected dtype int64 for index.")
    if index.dim() > 1:
        raise RuntimeError("Index has to be a vector/scalar")


@_checks("index_select")
def _index_select(_name: str, /, self: torch.Tensor, dim: int, index: torch.Tensor,
                  out: torch.Tensor | None = None) -> None:
    dim = _wrap(dim, self.dim())
    if index.dim() > 1:
        raise IndexError("index_select(): Index is supposed to be a vector")
    if index.dtype not in (torch.int64, torch.int32):
        raise RuntimeError("index_select(): Expected dtype int32 or int64 for index")
    if self.dim() > 1 and index.numel() and self.shape[dim] == 0:
        raise RuntimeError("index_select(): self indexing axis dim should be positive")
    if self.dim() == 1 and index.numel() and self.shape[0] == 0:
        raise IndexError("index out of range in self")  # every index is out of range
    if out is not None and out.dtype != self.dtype:
        raise RuntimeError("index_select(): self and result must have the same scalar type")


# --- advanced indexing -------------------------------------------------------------------------


def _integer_indices(indices: Sequence[Any]) -> bool:
    return all(i is None or i.dtype not in (torch.bool, torch.uint8) for i in indices)


def _check_empty_dims(self: torch.Tensor, indices: Sequence[Any]) -> None:
    """The index tensors broadcast together, and none indexes an empty dim (CPU's order)."""
    given = [i for i in indices if i is not None]
    try:
        torch.broadcast_shapes(*[i.shape for i in given])
    except RuntimeError:
        shapes = ", ".join(str(_sizes(i)) for i in given)
        raise IndexError(f"shape mismatch: indexing tensors could not be broadcast together with shapes {shapes}"
                         ) from None
    for size, index in zip(self.shape, indices):
        if index is not None and size == 0 and index.numel():
            raise IndexError("index is out of bounds for dimension with size 0")


@_checks("index")
def _index(_name: str, /, self: torch.Tensor, indices: Sequence[Any], **_: Any) -> None:
    if _integer_indices(indices):
        _check_empty_dims(self, indices)


@_checks("index_put", "_index_put_impl")
def _index_put(_name: str, /, self: torch.Tensor, indices: Sequence[Any], values: torch.Tensor, **_: Any) -> None:
    if not _integer_indices(indices) or len(indices) > self.dim():
        return
    _check_empty_dims(self, indices)
    selected = list(torch.ops.aten.index.Tensor(self, list(indices)).shape)
    try:
        fits = list(torch.broadcast_shapes(values.shape, selected)) == selected
    except RuntimeError:
        fits = False
    if not fits:
        raise RuntimeError(f"shape mismatch: value tensor of shape {_sizes(values)} cannot be broadcast to indexing "
                           f"result of shape {selected}")


@_checks("masked_scatter")
def _masked_scatter(_name: str, /, self: torch.Tensor, mask: torch.Tensor, source: torch.Tensor, **_: Any) -> None:
    if mask.dtype != torch.bool:
        raise RuntimeError(f"masked_scatter_ only supports boolean masks, but got mask with dtype "
                           f"{scalar_type_name(mask.dtype)}")


@_checks("as_strided_scatter")
def _as_strided_scatter(_name: str, /, self: torch.Tensor, src: torch.Tensor, size: Sequence[int],
                        stride: Sequence[int], storage_offset: int | None = None, **_: Any) -> None:
    """The view is taken of a contiguous copy of self: it must fit in self's elements."""
    offset = storage_offset or 0
    itemsize = self.dtype.itemsize
    needed = 0 if 0 in size else itemsize * (offset + 1 + sum((n - 1) * s for n, s in zip(size, stride)))
    if needed > self.numel() * itemsize:
        raise RuntimeError(f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset {offset}, and "
                           f"itemsize {itemsize} requiring a storage size of {needed} are out of bounds for storage "
                           f"of size {self.numel() * itemsize}")


@_checks("embedding")
def _embedding(_name: str, /, weight: torch.Tensor, indices: torch.Tensor, **_: Any) -> None:
    if weight.dim() != 2:
        raise RuntimeError("'weight' must be 2-D")


@_checks("bucketize")
def _bucketize(_name: str, /, self: Any, boundaries: torch.Tensor, **_: Any) -> None:
    if boundaries.dim() != 1:
        raise RuntimeError(f"boundaries tensor must be 1 dimension, but got dim({boundaries.dim()})")


# --- joining and narrowing ---------------------------------------------------------------------


@_checks("cat")
def _cat(_name: str, /, tensors: Sequence[torch.Tensor], dim: int = 0, **_: Any) -> None:
    """CPU refuses 0-d tensors first, then wraps dim by the first tensor that is not a legacy empty [0]."""
    for position, t in enumerate(tensors):
        if t.dim() == 0:
            raise RuntimeError(f"zero-dimensional tensor (at position {position}) cannot be concatenated")
    reference = next((t for t in tensors if list(t.shape) != [0]), None)
    if reference is not None:
        _wrap(dim, reference.dim())


@_checks("stack")
def _stack(_name: str, /, tensors: Sequence[torch.Tensor], dim: int = 0, **_: Any) -> None:
    """CPU wraps dim by the first tensor's rank, then compares the sizes (before the dim's other checks)."""
    if tensors:
        _wrap(dim, tensors[0].dim() + 1)
    for position, t in enumerate(tensors[1:], 1):
        if t.shape != tensors[0].shape:
            raise RuntimeError(f"stack expects each tensor to be equal size, but got {_sizes(tensors[0])} at entry 0 "
                               f"and {_sizes(t)} at entry {position}")


@_checks("narrow_copy")
def _narrow_copy(_name: str, /, self: torch.Tensor, dim: int, **_: Any) -> None:
    if dim >= self.dim():
        raise RuntimeError("Expected dim < static_cast<int64_t>(self_sizes.size()) to be true, but got false.  "
                           "(Could this error message be improved?  If so, please report an enhancement request "
                           "to PyTorch.)")


# --- class indices -----------------------------------------------------------------------------


@_checks("nll_loss_forward", "nll_loss2d_forward")
def _nll_loss(_name: str, /, self: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, **_: Any) -> None:
    if target.dtype not in (torch.int64, torch.uint8):
        raise RuntimeError(f"expected target dtype to be Long or Byte, but got {scalar_type_name(target.dtype)}")
    classes = self.shape[-1] if self.dim() <= 2 else self.shape[1]
    if weight is not None and weight.numel() != classes:
        raise RuntimeError(f"weight tensor should be defined either for all {classes} classes or no classes but got "
                           f"weight tensor of shape: {_sizes(weight)}")


# --- factories ---------------------------------------------------------------------------------


@_checks("empty", "zeros", "ones", "full", "rand", "randn", "randint")
def _factory(_name: str, /, size: Sequence[int] = (), dtype: torch.dtype | None = None,
             **_: Any) -> None:
    itemsize = (dtype or torch.get_default_dtype()).itemsize
    if math.prod(size) * itemsize >= 2**63:
        raise RuntimeError(f"Storage size calculation overflowed with sizes={list(size)}")


@_checks("multinomial")
def _multinomial(_name: str, /, self: torch.Tensor, *, out: torch.Tensor | None = None, **_: Any) -> None:
    if out is not None and out.dtype != torch.int64:
        raise RuntimeError(f"multinomial expects Long tensor out, got: {scalar_type_name(out.dtype)}")


# --- convolution -------------------------------------------------------------------------------


@_checks("convolution", "_convolution")
def _convolution(_name: str, /, input: torch.Tensor, weight: torch.Tensor, bias: Any, stride: Sequence[int],  # noqa: A002
                 padding: Sequence[int], dilation: Sequence[int], **_: Any) -> None:
    if any(p < 0 for p in padding):
        raise RuntimeError("negative padding is not supported")
    if any(s <= 0 for s in stride):
        raise RuntimeError("non-positive stride is not supported")
    if any(d <= 0 for d in dilation):
        raise RuntimeError(f"dilation should be greater than zero, but got {list(dilation)}")


# --- complex numbers ---------------------------------------------------------------------------


_COMPLEX_OF = {torch.float16: torch.complex32, torch.float32: torch.complex64, torch.float64: torch.complex128}


@_checks("complex")
def _complex(_name: str, /, real: torch.Tensor, imag: torch.Tensor, out: torch.Tensor | None = None) -> None:
    if real.dtype not in _COMPLEX_OF or imag.dtype not in _COMPLEX_OF:
        raise RuntimeError("Expected both inputs to be Half, Float or Double tensors but got "
                           f"{scalar_type_name(real.dtype)} and {scalar_type_name(imag.dtype)}")
    if real.dtype != imag.dtype:
        raise RuntimeError(f"Expected object of scalar type {scalar_type_name(real.dtype)} but got scalar type "
                           f"{scalar_type_name(imag.dtype)} for second argument")
    expected = _COMPLEX_OF[real.dtype]
    if out is not None and out.dtype != expected:
        raise RuntimeError(f"Expected object of scalar type {scalar_type_name(expected)} but got scalar type "
                           f"{scalar_type_name(out.dtype)} for argument 'out'")


# --- reductions without an identity ------------------------------------------------------------


def _dims(dim: int | Sequence[int] | None) -> list[int]:
    return [] if dim is None else [dim] if isinstance(dim, int) else list(dim)


def _nonempty_dims(self: torch.Tensor, dims: list[int], name: str) -> None:
    """CPU's IndexError for a reduction without identity over an empty dim (the dim as given)."""
    for dim in dims:
        if self.dim() and self.shape[_wrap(dim, self.dim())] == 0:
            raise IndexError(f"{name} Expected reduction dim {dim} to have non-zero size.")


_NO_DIM = ("(): Expected reduction dim to be specified for input.numel() == 0. Specify the reduction dim with the "
           "'dim' argument.")


@_checks("amax", "amin")
def _amax(name: str, /, self: torch.Tensor, dim: Sequence[int] = (), keepdim: bool = False,
          out: torch.Tensor | None = None) -> None:
    if not _dims(dim) and self.numel() == 0:
        raise RuntimeError(name + _NO_DIM)
    _nonempty_dims(self, _dims(dim), f"{name}():")
    if out is not None and out.dtype != self.dtype:
        raise RuntimeError(f"Expected the dtype for input and out to match, but got {scalar_type_name(self.dtype)} "
                           f"for input's dtype and {scalar_type_name(out.dtype)} for out's dtype.")


@_checks("aminmax")
def _aminmax(_name: str, /, self: torch.Tensor, *, dim: int | None = None, keepdim: bool = False,
             min: torch.Tensor | None = None, max: torch.Tensor | None = None) -> None:  # noqa: A002
    if dim is None and self.numel() == 0:
        raise RuntimeError("aminmax(): cannot compute aminmax over an empty dimension as the operation has no "
                           "identity.")
    _nonempty_dims(self, _dims(dim), "aminmax:")
    _out_dtype(min, self.dtype)
    _out_dtype(max, self.dtype)


@_checks("max", "min")
def _max(name: str, /, self: torch.Tensor, dim: int | None = None, **others: Any) -> None:
    """max(x) and max(x, dim); max(x, other) is elementwise."""
    if "other" in others:
        return
    if dim is None and self.numel() == 0:
        raise RuntimeError(name + _NO_DIM)
    _nonempty_dims(self, _dims(dim), f"{name}():")


@_checks("argmax", "argmin")
def _argmax(name: str, /, self: torch.Tensor, dim: int | None = None, keepdim: bool = False, **_: Any) -> None:
    if dim is None and self.numel() == 0:
        raise IndexError(f"{name}(): Expected reduction dim to be specified for input.numel() == 0.")
    _nonempty_dims(self, _dims(dim), f"{name}():")


# --- powers ------------------------------------------------------------------------------------


@_checks("pow")
def _pow(_name: str, /, self: Any, exponent: Any, **_: Any) -> None:
    """A bool result has no power kernel on CPU but a bool tensor raised to a bool scalar (a copy or a fill);
    PyTorch's meta kernel promotes bool to int64 instead."""
    if isinstance(self, torch.Tensor) and not isinstance(exponent, torch.Tensor):
        return
    if torch.result_type(self, exponent) == torch.bool:
        raise NotImplementedError("\"pow\" not implemented for 'Bool'")


def _pow_tensor_scalar_meta(op: OpOverload) -> Callable[..., torch.Tensor]:
    """pow's meta kernel, except for a bool tensor raised to a bool: bool on CPU (result_type's dtype: True copies
    self, False fills ones), where PyTorch's gives int64 and its in-place and out= forms refuse that cast."""

    def meta(self: torch.Tensor, exponent: Any, **out: torch.Tensor) -> torch.Tensor:
        if self.dtype != torch.bool or not isinstance(exponent, bool):
            return op(self, exponent, **out)
        if op is torch.ops.aten.pow_.Scalar:
            return self
        if out:
            return out["out"].resize_(self.shape)
        return torch.empty_like(self)

    return meta


META_KERNELS: dict[OpOverload, Callable[..., Any]] = {
    op: _pow_tensor_scalar_meta(op)
    for op in (torch.ops.aten.pow.Tensor_Scalar, torch.ops.aten.pow_.Scalar, torch.ops.aten.pow.Tensor_Scalar_out)
}


# --- selection ---------------------------------------------------------------------------------


@_checks("kthvalue")
def _kthvalue(_name: str, /, self: torch.Tensor, k: int, dim: int = -1, keepdim: bool = False,
              values: torch.Tensor | None = None, indices: torch.Tensor | None = None) -> None:
    if values is not None and values.dtype != self.dtype:
        raise RuntimeError("output values must be of same type as input")
    if indices is not None and indices.dtype != torch.int64:
        raise RuntimeError("output indices must be of scalar type Long")


@_checks("sort")
def _sort(_name: str, /, self: torch.Tensor, *, values: torch.Tensor | None = None, indices: torch.Tensor | None = None,
          **_: Any) -> None:
    _out_dtype(values, self.dtype)
    _out_dtype(indices, torch.int64)


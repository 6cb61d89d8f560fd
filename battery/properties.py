"""Property-based bad inputs for battery.run_errors: hypothesis strategies over the ops that index or validate.

Each property draws one call (a Case): shapes of 0 to 3 dims with sides 0 to 4 (0-d and empty tensors
included), dtypes, index values in and around the valid range (negative, one past the end, huge), NaN and
infinities, and operands viewed non-contiguously (transposed, strided, offset) or overlapping (expanded,
as_strided windows), so that a view's own rules (an in-place op on an expanded tensor) are exercised
too. Values are random from a drawn seed, never zeros. `explore` runs a property derandomized: the same
cases for the same count on every run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch.testing._internal.opinfo.core import SampleInput

from battery.run_errors import Case

FLOATS = (torch.float32, torch.float64, torch.bfloat16)
INDEX_DTYPES = (torch.int64, torch.int64, torch.int64, torch.int32, torch.float32)
SPECIALS = (math.nan, math.inf, -math.inf, 0.0, -0.0, 1e38)
# the layouts an operand is viewed in; WRITABLE leaves out as_strided windows, whose overlapping writes have no
# defined result on CPU (expanded ones do: CPU raises)
LAYOUTS = ("contiguous", "contiguous", "transposed", "strided", "offset", "expanded", "as_strided")
WRITABLE = LAYOUTS[:-1]
HUGE = (2**31, 2**40, 2**62)


@dataclasses.dataclass
class Operand:
    """A tensor argument: the base tensor the sample carries, and the view of it the call receives."""

    base: torch.Tensor
    layout: str
    shape: tuple[int, ...]
    text: str

    def view(self, base: torch.Tensor) -> torch.Tensor:
        return shaped(base, self.layout, self.shape)


def shaped(base: torch.Tensor, layout: str, shape: tuple[int, ...]) -> torch.Tensor:
    """`base` (made by base_shape) viewed as `shape` in `layout`."""
    if layout == "transposed":
        return base.permute(*reversed(range(base.dim())))
    if layout == "strided":
        return base[..., ::2]
    if layout == "offset":
        return base[1:]
    if layout == "expanded":
        return base.expand(shape)
    if layout == "as_strided":
        return base.as_strided(shape, (1,) * len(shape))
    return base


def base_shape(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if layout == "transposed":
        return tuple(reversed(shape))
    if layout == "strided":
        return (*shape[:-1], 2 * shape[-1])
    if layout == "offset":
        return (shape[0] + 1, *shape[1:])
    if layout == "expanded":
        return (1, *shape[1:])
    if layout == "as_strided":
        return (sum(max(s - 1, 0) for s in shape) + 1,)
    return shape


def values(shape: tuple[int, ...], dtype: torch.dtype, seed: int, specials: tuple[float, ...] = ()) -> torch.Tensor:
    """Random values of `dtype` from `seed`, with `specials` written at the first positions (floats only)."""
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        made = (torch.randn(shape, generator=generator, dtype=torch.float64) * 3).to(dtype)
        flat = made.view(-1)
        for position, special in enumerate(specials[:flat.numel()]):
            flat[position] = special
        return made
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    return torch.randint(-9, 10, shape, generator=generator, dtype=dtype)


@st.composite
def shapes(draw: Any, min_dims: int = 0, max_dims: int = 3, min_side: int = 0, max_side: int = 4) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.integers(min_side, max_side), min_size=min_dims, max_size=max_dims)))


@st.composite
def tensors(draw: Any, shape: tuple[int, ...] | None = None, dtypes: tuple[torch.dtype, ...] = FLOATS,
            layouts: tuple[str, ...] = LAYOUTS, special: bool = True, min_dims: int = 0) -> Operand:
    """An operand of `shape` (drawn when None) in a drawn dtype and layout, with NaN/inf/zeros sometimes."""
    shape = draw(shapes(min_dims=min_dims)) if shape is None else tuple(shape)
    dtype = draw(st.sampled_from(dtypes))
    usable = [name for name in layouts if _fits(name, shape)]
    layout = draw(st.sampled_from(usable))
    specials = tuple(draw(st.lists(st.sampled_from(SPECIALS), max_size=3))) if special else ()
    base = values(base_shape(layout, shape), dtype, draw(st.integers(0, 2**16)), specials)
    marks = f" with {', '.join(map(str, specials))}" if specials and dtype.is_floating_point else ""
    text = f"{str(dtype).removeprefix('torch.')}{list(shape)}" + ("" if layout == "contiguous" else f" {layout}")
    return Operand(base, layout, shape, text + marks)


def _fits(layout: str, shape: tuple[int, ...]) -> bool:
    if layout in ("strided", "offset", "expanded"):
        return len(shape) >= 1
    if layout == "transposed":
        return len(shape) >= 2
    return True


@st.composite
def indices(draw: Any, size: int, shape: tuple[int, ...] | None = None, dtypes: tuple[torch.dtype, ...] = INDEX_DTYPES,
            low: int | None = None) -> Operand:
    """An index tensor for a dimension of `size`: mostly valid values, then negative ones, one past the end,
    huge ones; in a drawn dtype (a float index is itself an error for most ops)."""
    shape = draw(shapes(max_dims=2)) if shape is None else tuple(shape)
    count = math.prod(shape)
    low = -size - 1 if low is None else low
    valid = st.integers(max(low, -size), max(size - 1, max(low, -size)))
    wrong = st.sampled_from([size, size + 1, -size - 1, 2**40, -(2**40)])
    drawn = draw(st.lists(st.one_of(valid, valid, valid, wrong), min_size=count, max_size=count))
    dtype = draw(st.sampled_from(dtypes))
    base = torch.tensor(drawn, dtype=torch.int64).reshape(shape).to(dtype)
    return Operand(base, "contiguous", shape, f"{str(dtype).removeprefix('torch.')} {base.tolist()}")


def duplicates(index: Operand, size: int) -> bool:
    """Whether an index names one position twice (a plain write then has no defined winner on CPU)."""
    normal = [v % size for v in index.base.reshape(-1).long().tolist() if size and -size <= v < size]
    return len(set(normal)) < len(normal)


def case(name: str, call: Callable[..., Any], *args: Any, random: bool = False, **kwargs: Any) -> Case:
    """A Case calling `call(*args, **kwargs)`: Operands travel as their base tensors and are viewed in the call;
    a list of Operands (cat's) likewise."""

    def unpack(value: Any) -> Any:
        if isinstance(value, Operand):
            return value.base
        if isinstance(value, list) and value and isinstance(value[0], Operand):
            return [v.base for v in value]
        return value

    plan = [value.view if isinstance(value, Operand) else
            [v.view for v in value] if isinstance(value, list) and value and isinstance(value[0], Operand) else None
            for value in args]

    def fn(*bases: Any, **keywords: Any) -> Any:
        viewed = [b if p is None else p(b) if callable(p) else [v(t) for v, t in zip(p, b)]
                  for p, b in zip(plan, bases)]
        return call(*viewed, **keywords)

    packed = [unpack(a) for a in args]
    sample = SampleInput(packed[0], args=tuple(packed[1:]), kwargs=kwargs)
    text = lambda v: v.text if isinstance(v, Operand) else f"[{', '.join(text(t) for t in v)}]" if isinstance(
        v, list) and v and isinstance(v[0], Operand) else repr(v)
    shown = [text(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return Case(fn, sample, f"{name}({'; '.join(shown)})", random=random)


def _dim(draw: Any, ndim: int) -> int:
    """A dimension: usually valid, sometimes one out of range either side."""
    span = max(ndim, 1)
    valid = st.integers(-span, span - 1)
    return draw(st.one_of(valid, valid, st.sampled_from([span, -span - 1])))


def _dim_and_size(draw: Any, x: Operand) -> tuple[int, int]:
    """A dimension of x (sometimes out of range) and the size an index along it addresses (1 if none)."""
    dim = _dim(draw, len(x.shape))
    return dim, x.shape[dim] if -len(x.shape) <= dim < len(x.shape) else 1


# --- indexing ---------------------------------------------------------------------------------


@st.composite
def index(draw: Any) -> Case:
    x = draw(tensors(min_dims=1))
    forms = ["x[i]", "x[i, j]", "x[:, i]", "x[mask]"] if len(x.shape) >= 2 else ["x[i]", "x[mask]"]
    form = draw(st.sampled_from(forms))
    if form == "x[mask]":
        shape = list(x.shape[:draw(st.integers(1, len(x.shape)))])
        if draw(st.booleans()):
            shape[-1] += 1
        mask = draw(tensors(tuple(shape), dtypes=(torch.bool,), layouts=("contiguous",)))
        return case(form, lambda t, m: t[m], x, mask)
    i = draw(indices(x.shape[1] if form == "x[:, i]" else x.shape[0]))
    if form == "x[i, j]":
        j = draw(indices(x.shape[1], shape=tuple(i.shape) if draw(st.booleans()) else None))
        return case(form, lambda t, a, b: t[a, b], x, i, j)
    return case(form, (lambda t, a: t[:, a]) if form == "x[:, i]" else (lambda t, a: t[a]), x, i)


@st.composite
def index_put(draw: Any) -> Case:
    x = draw(tensors(min_dims=1, layouts=WRITABLE))
    i = draw(indices(x.shape[0], shape=draw(shapes(1, 1))))
    accumulate = draw(st.booleans())
    shape = (i.shape[0], *x.shape[1:]) if draw(st.integers(0, 3)) else draw(shapes(max_dims=2))
    v = draw(tensors(shape, dtypes=(x.base.dtype,), layouts=LAYOUTS, special=False))
    return case("x.index_put_((i,), v)", lambda t, a, b: t.index_put_((a,), b, accumulate=accumulate), x, i, v,
                random=not accumulate and duplicates(i, x.shape[0]))


def _index_like(draw: Any, x: Operand, dim: int) -> tuple[int, ...]:
    """An index shape for gather/scatter along `dim`: at most the input's sides, one over sometimes, and
    sometimes another rank."""
    ndim = len(x.shape)
    shape = [draw(st.integers(0, side)) for side in x.shape]
    if ndim and draw(st.integers(0, 4)) == 0:
        shape[draw(st.integers(0, ndim - 1))] += 1
    if draw(st.integers(0, 6)) == 0:
        shape = shape[:-1] if shape and draw(st.booleans()) else [*shape, 1]
    return tuple(shape)


@st.composite
def gather(draw: Any) -> Case:
    x = draw(tensors())
    dim, size = _dim_and_size(draw, x)
    i = draw(indices(size, shape=_index_like(draw, x, dim), dtypes=(torch.int64, torch.int64, torch.int32)))
    return case("torch.gather(x, dim, i)", torch.gather, x, dim, i)


@st.composite
def scatter(draw: Any) -> Case:
    x = draw(tensors(layouts=WRITABLE))
    dim, size = _dim_and_size(draw, x)
    i = draw(indices(size, shape=_index_like(draw, x, dim), dtypes=(torch.int64, torch.int64, torch.int32)))
    src_shape = tuple(s + draw(st.integers(0, 1)) for s in i.shape) if draw(st.integers(0, 4)) else draw(shapes())
    src = draw(tensors(src_shape, dtypes=(x.base.dtype,) * 3 + FLOATS, special=False))
    form = draw(st.sampled_from(["scatter_", "scatter_add_", "scatter_reduce_", "scatter_value_", "scatter_add"]))
    repeated = duplicates(i, size)
    if form == "scatter_reduce_":
        reduce, include_self = draw(st.sampled_from(["sum", "prod", "mean", "amax", "amin"])), draw(st.booleans())
        return case(f"x.scatter_reduce_(dim, i, src, {reduce!r})",
                    lambda t, d, a, s: t.scatter_reduce_(d, a, s, reduce, include_self=include_self), x, dim, i, src,
                    random=repeated and reduce in ("sum", "prod", "mean"))  # float sums in an unspecified order
    if form == "scatter_value_":
        return case("x.scatter_(dim, i, 1.5)", lambda t, d, a: t.scatter_(d, a, 1.5), x, dim, i)
    if form == "scatter_":
        return case("x.scatter_(dim, i, src)", lambda t, d, a, s: t.scatter_(d, a, s), x, dim, i, src, random=repeated)
    call = (lambda t, d, a, s: t.scatter_add_(d, a, s)) if form == "scatter_add_" else torch.scatter_add
    return case(f"{form}(x, dim, i, src)", call, x, dim, i, src, random=repeated)


@st.composite
def index_select(draw: Any) -> Case:
    x = draw(tensors())
    dim, size = _dim_and_size(draw, x)
    i = draw(indices(size, shape=draw(shapes(max_dims=2, max_side=3)), low=-1))
    return case("torch.index_select(x, dim, i)", torch.index_select, x, dim, i)


@st.composite
def index_add_copy_fill(draw: Any) -> Case:
    x = draw(tensors(layouts=WRITABLE))
    dim, size = _dim_and_size(draw, x)
    i = draw(indices(size, shape=draw(shapes(max_dims=2 if draw(st.integers(0, 5)) == 0 else 1, max_side=3)), low=-2))
    form = draw(st.sampled_from(["index_add_", "index_copy_", "index_fill_"]))
    if form == "index_fill_":
        return case("x.index_fill_(dim, i, -2.5)", lambda t, d, a: t.index_fill_(d, a, -2.5), x, dim, i)
    shape = list(x.shape) or [1]
    if -len(shape) <= dim < len(shape):
        shape[dim] = math.prod(i.shape)
    if draw(st.integers(0, 3)) == 0:
        shape = list(draw(shapes()))
    source = draw(tensors(tuple(shape), dtypes=(x.base.dtype,), special=False))
    if form == "index_add_":
        alpha = draw(st.sampled_from([1, -2, 0.5]))
        return case(f"x.index_add_(dim, i, source, alpha={alpha})",
                    lambda t, d, a, s: t.index_add_(d, a, s, alpha=alpha), x, dim, i, source)
    return case("x.index_copy_(dim, i, source)", lambda t, d, a, s: t.index_copy_(d, a, s), x, dim, i, source,
                random=duplicates(i, size))


@st.composite
def take_put(draw: Any) -> Case:
    x = draw(tensors(layouts=WRITABLE))
    numel = math.prod(x.shape)
    i = draw(indices(numel, shape=draw(shapes(max_dims=2))))
    if draw(st.booleans()):
        return case("torch.take(x, i)", torch.take, x, i)
    accumulate = draw(st.booleans())
    count = math.prod(i.shape) + (draw(st.sampled_from([0, 0, 0, 1, -1])) if i.shape else 0)
    source = draw(tensors((max(count, 0),), dtypes=(x.base.dtype,), special=False))
    return case(f"x.put_(i, source, accumulate={accumulate})", lambda t, a, s: t.put_(a, s, accumulate=accumulate),
                x, i, source, random=not accumulate and duplicates(i, numel))


@st.composite
def embedding(draw: Any) -> Case:
    rows, width = draw(st.integers(1, 5)), draw(st.integers(0, 3))
    weight = draw(tensors((rows, width), dtypes=(torch.float32, torch.float64), special=False))
    ids = draw(indices(rows, dtypes=(torch.int64, torch.int64, torch.int32)))
    if draw(st.booleans()):
        padding_idx = draw(st.sampled_from([None, 0, -1, rows - 1]))
        return case(f"F.embedding(ids, weight, padding_idx={padding_idx})",
                    lambda a, w: F.embedding(a, w, padding_idx=padding_idx), ids, weight)
    ids = draw(indices(rows, shape=draw(shapes(1, 2, min_side=1)), dtypes=(torch.int64, torch.int32)))
    mode = draw(st.sampled_from(["sum", "mean", "max"]))
    if ids.base.dim() == 2:
        return case(f"F.embedding_bag(ids, weight, mode={mode!r})", lambda a, w: F.embedding_bag(a, w, mode=mode),
                    ids, weight)
    offsets = draw(st.lists(st.integers(-1, ids.shape[0] + 1), min_size=1, max_size=3))
    offsets_tensor = torch.tensor(offsets, dtype=ids.base.dtype)
    return case(f"F.embedding_bag(ids, weight, offsets={offsets}, mode={mode!r})",
                lambda a, w, o: F.embedding_bag(a, w, o, mode=mode), ids, weight, offsets_tensor)


# --- losses and validating ops ------------------------------------------------------------------


@st.composite
def nll_cross_entropy(draw: Any) -> Case:
    classes = draw(st.integers(1, 4))
    layout = draw(st.sampled_from(["(C,)", "(N, C)", "(N, C, d)"]))
    batch = draw(st.integers(0, 3))
    shape = {"(C,)": (classes,), "(N, C)": (batch, classes), "(N, C, d)": (batch, classes, 2)}[layout]
    logits = draw(tensors(shape, dtypes=(torch.float32, torch.float64)))
    target_shape = shape[:1] * 0 if layout == "(C,)" else (batch,) if layout == "(N, C)" else (batch, 2)
    if draw(st.integers(0, 5)) == 0:
        target_shape = draw(shapes(max_dims=2))
    ignore_index = draw(st.sampled_from([-100, -100, 0, classes - 1, -1]))
    target = draw(indices(classes, shape=target_shape, dtypes=(torch.int64, torch.int64, torch.int32), low=-2))
    weight = None if draw(st.booleans()) else values((classes + draw(st.sampled_from([0, 0, 1])),), logits.base.dtype,
                                                     draw(st.integers(0, 99))).abs() + 0.1
    reduction = draw(st.sampled_from(["mean", "sum", "none"]))
    if draw(st.booleans()):
        return case(f"F.nll_loss(x, t, ignore_index={ignore_index}, reduction={reduction!r})",
                    lambda x, t, w: F.nll_loss(x, t, w, ignore_index=ignore_index, reduction=reduction),
                    logits, target, weight)
    smoothing = draw(st.sampled_from([0.0, 0.0, 0.25, 1.5, -0.1]))
    if draw(st.integers(0, 3)) == 0:  # class probabilities as the target
        target = draw(tensors(shape if draw(st.integers(0, 3)) else draw(shapes()), dtypes=(logits.base.dtype,),
                              special=False))
    return case(f"F.cross_entropy(x, t, ignore_index={ignore_index}, reduction={reduction!r}, "
                f"label_smoothing={smoothing})",
                lambda x, t, w: F.cross_entropy(x, t, w, ignore_index=ignore_index, reduction=reduction,
                                                label_smoothing=smoothing), logits, target, weight)


@st.composite
def one_hot(draw: Any) -> Case:
    classes = draw(st.sampled_from([-1, -1, 0, 1, 3, 5]))
    t = draw(indices(max(classes, 3), dtypes=(torch.int64, torch.int64, torch.int64, torch.int32), low=-2))
    return case(f"F.one_hot(t, num_classes={classes})", lambda a: F.one_hot(a, classes), t)


@st.composite
def bincount(draw: Any) -> Case:
    t = draw(indices(6, shape=draw(shapes(max_dims=2)) if draw(st.integers(0, 5)) == 0 else draw(shapes(1, 1)),
                     dtypes=(torch.int64, torch.int64, torch.int32, torch.float32), low=-2))
    minlength = draw(st.sampled_from([0, 0, 3, 10, -1]))
    count = math.prod(t.shape) + draw(st.sampled_from([0, 0, 0, 1]))
    weights = None if draw(st.booleans()) else draw(tensors((count,), dtypes=(torch.float32, torch.float64),
                                                            special=False))
    return case(f"torch.bincount(t, weights, minlength={minlength})",
                lambda a, w: torch.bincount(a, w, minlength=minlength), t, weights)


@st.composite
def repeat_interleave(draw: Any) -> Case:
    form = draw(st.sampled_from(["repeats only", "int repeats", "tensor repeats"]))
    repeats = draw(indices(4, shape=draw(shapes(max_dims=1 if draw(st.integers(0, 5)) else 2, max_side=4)),
                           dtypes=(torch.int64, torch.int64, torch.int32, torch.float32), low=-1))
    if form == "repeats only":
        return case("torch.repeat_interleave(repeats)", torch.repeat_interleave, repeats)
    x = draw(tensors())
    dim = None if draw(st.booleans()) else _dim(draw, len(x.shape))
    if form == "int repeats":
        count = draw(st.sampled_from([0, 2, -1]))
        return case(f"torch.repeat_interleave(x, {count}, dim={dim})",
                    lambda t: torch.repeat_interleave(t, count, dim=dim), x)
    return case(f"torch.repeat_interleave(x, repeats, dim={dim})",
                lambda t, r: torch.repeat_interleave(t, r, dim=dim), x, repeats)


@st.composite
def multinomial(draw: Any) -> Case:
    p = draw(tensors(draw(shapes(1, 2, max_side=4)), dtypes=(torch.float32, torch.float64, torch.int64)))
    absolute = draw(st.integers(0, 3)) > 0  # mostly valid probabilities, so that their specials matter
    samples = draw(st.sampled_from([1, 2, 3, 5, 0, -1]))
    replacement = draw(st.booleans())
    return case(f"torch.multinomial({'|p|' if absolute else 'p'}, {samples}, replacement={replacement})",
                lambda t: torch.multinomial(t.abs() if absolute and t.is_floating_point() else t, samples, replacement),
                p, random=True)


@st.composite
def binary_cross_entropy(draw: Any) -> Case:
    shape = draw(shapes())
    x = draw(tensors(shape, dtypes=(torch.float32, torch.float64)))
    target_shape = shape if draw(st.integers(0, 4)) else draw(shapes())
    y = draw(tensors(target_shape, dtypes=(x.base.dtype,)))
    squash_input, squash_target = draw(st.integers(0, 3)) > 0, draw(st.integers(0, 3)) > 0
    weight = None if draw(st.booleans()) else values(shape, x.base.dtype, draw(st.integers(0, 99))).abs()
    reduction = draw(st.sampled_from(["mean", "sum", "none"]))
    return case(f"F.binary_cross_entropy({'sigmoid(x)' if squash_input else 'x'}, "
                f"{'sigmoid(y)' if squash_target else 'y'}, weight, reduction={reduction!r})",
                lambda a, b, w: F.binary_cross_entropy(a.sigmoid() if squash_input else a,
                                                       b.sigmoid() if squash_target else b, w, reduction=reduction),
                x, y, weight)


# --- shapes -----------------------------------------------------------------------------------


@st.composite
def _sizes(draw: Any, numel: int) -> list[int]:
    """Target sizes for a tensor of `numel` elements: a factorisation, -1s, zeros, a wrong product, a huge side."""
    kind = draw(st.sampled_from(["factor", "factor", "minus one", "wrong", "huge", "two minus ones", "negative"]))
    sizes = [numel] if numel else [0]
    if kind in ("factor", "minus one") and numel > 1:
        first = draw(st.sampled_from([d for d in range(1, numel + 1) if numel % d == 0]))
        sizes = [first, numel // first]
    if kind == "minus one":
        sizes[draw(st.integers(0, len(sizes) - 1))] = -1
    elif kind == "wrong":
        sizes.append(draw(st.sampled_from([2, 3])))
    elif kind == "huge":
        sizes = [draw(st.sampled_from(HUGE)), *sizes]
    elif kind == "two minus ones":
        sizes = [-1, -1]
    elif kind == "negative":
        sizes = [-2, *sizes]
    return sizes


@st.composite
def view_reshape(draw: Any) -> Case:
    x = draw(tensors(special=False))
    sizes = draw(_sizes(math.prod(x.shape)))
    form = draw(st.sampled_from(["view", "reshape", "flatten then unflatten"]))
    if form == "flatten then unflatten":
        return case(f"x.flatten().unflatten(0, {sizes})", lambda t: t.flatten().unflatten(0, sizes), x)
    return case(f"x.{form}({sizes})", (lambda t: t.view(sizes)) if form == "view" else (lambda t: t.reshape(sizes)), x)


@st.composite
def expand(draw: Any) -> Case:
    x = draw(tensors(special=False))
    sizes = [draw(st.sampled_from([s, s, -1, 1, 3] if s == 1 else [s, s, -1, s + 1, 0])) for s in x.shape]
    lead = draw(st.lists(st.sampled_from([2, 0, -1, 2**40]), max_size=2))
    sizes = lead + sizes
    materialise = draw(st.booleans()) and all(s < 2**31 for s in sizes)
    return case(f"x.expand({sizes})" + (" * 2" if materialise else ""),
                (lambda t: t.expand(sizes) * 2) if materialise else (lambda t: t.expand(sizes).shape), x)


@st.composite
def cat_stack(draw: Any) -> Case:
    shape = draw(shapes(max_side=3))
    count = draw(st.integers(0, 3))
    parts = []
    for _ in range(count):
        varied = list(shape)
        if varied and draw(st.integers(0, 2)) == 0:
            varied[draw(st.integers(0, len(varied) - 1))] = draw(st.integers(0, 3))
        if draw(st.integers(0, 6)) == 0:
            varied = varied[:-1] if varied else [0]
        parts.append(draw(tensors(tuple(varied), dtypes=FLOATS + (torch.int64,), special=False)))
    dim = _dim(draw, len(shape) + 1)
    form = draw(st.sampled_from(["cat", "stack", "hstack"]))
    call = {"cat": lambda *ts: torch.cat(ts, dim), "stack": lambda *ts: torch.stack(ts, dim),
            "hstack": lambda *ts: torch.hstack(ts)}[form]
    if not parts:
        return case(f"torch.{form}([], {dim})", lambda empty: call(*empty), [])
    return case(f"torch.{form}(tensors, {dim})", call, *parts)


@st.composite
def narrow_select(draw: Any) -> Case:
    x = draw(tensors(special=False))
    dim = _dim(draw, len(x.shape))
    side = x.shape[dim] if -len(x.shape) <= dim < len(x.shape) else 1
    start = draw(st.one_of(st.integers(-side - 1, side + 1), st.sampled_from(HUGE)))
    form = draw(st.sampled_from(["narrow", "select", "slice", "unbind", "split"]))
    if form == "narrow":
        length = draw(st.integers(-1, side + 1))
        return case(f"x.narrow({dim}, {start}, {length})", lambda t: t.narrow(dim, start, length), x)
    if form == "select":
        return case(f"x.select({dim}, {start})", lambda t: t.select(dim, start), x)
    if form == "slice":
        step = draw(st.sampled_from([1, 2, 0, -1]))
        return case(f"x[..., {start}::{step}] (dim -1)", lambda t: t[..., start::step], x)
    if form == "unbind":
        return case(f"x.unbind({dim})", lambda t: t.unbind(dim), x)
    split = draw(st.sampled_from([1, 2, 0, -1]))
    return case(f"x.split({split}, {dim})", lambda t: t.split(split, dim), x)


@st.composite
def dims(draw: Any) -> Case:
    x = draw(tensors(special=False))
    ndim = len(x.shape)
    form = draw(st.sampled_from(["permute", "transpose", "squeeze", "unsqueeze", "movedim", "flatten", "diagonal"]))
    a, b = _dim(draw, ndim), _dim(draw, ndim)
    if form == "permute":
        order = list(draw(st.permutations(range(ndim))))
        if order and draw(st.booleans()):
            order[draw(st.integers(0, ndim - 1))] = a
        return case(f"x.permute({order})", lambda t: t.permute(order), x)
    if form == "unsqueeze":
        a = _dim(draw, ndim + 1)
    calls = {"transpose": lambda t: t.transpose(a, b), "squeeze": lambda t: t.squeeze(a),
             "unsqueeze": lambda t: t.unsqueeze(a), "movedim": lambda t: t.movedim(a, b),
             "flatten": lambda t: t.flatten(a, b), "diagonal": lambda t: t.diagonal(0, a, b)}
    return case(f"x.{form}({a}, {b})" if form not in ("squeeze", "unsqueeze") else f"x.{form}({a})", calls[form], x)


# --- pointwise and reductions -------------------------------------------------------------------

UNARY = ("exp", "log", "sqrt", "rsqrt", "sin", "tanh", "reciprocal", "abs", "sign", "floor", "round", "sigmoid",
         "erfinv", "isnan", "nan_to_num", "frac", "bitwise_not", "logical_not", "neg", "log1p", "acos")
BINARY = ("add", "sub", "mul", "div", "floor_divide", "remainder", "fmod", "pow", "atan2", "maximum", "fmin",
          "bitwise_and", "eq", "lt", "logical_and", "copysign", "xlogy", "ldexp", "bitwise_left_shift")
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32, torch.bool)


@st.composite
def pointwise_unary(draw: Any) -> Case:
    name = draw(st.sampled_from(UNARY))
    inplace = draw(st.integers(0, 2)) == 0
    x = draw(tensors(dtypes=DTYPES, layouts=WRITABLE if inplace else LAYOUTS))
    method = name + "_" if inplace else name
    return case(f"x.{method}()", lambda t: getattr(t, method)(), x)


@st.composite
def pointwise_binary(draw: Any) -> Case:
    name = draw(st.sampled_from(BINARY))
    inplace = draw(st.integers(0, 2)) == 0
    a = draw(tensors(dtypes=DTYPES, layouts=WRITABLE if inplace else LAYOUTS))
    shape = list(a.shape)
    for position in range(len(shape)):  # broadcastable mostly; a side that is neither 1 nor a's sometimes
        shape[position] = draw(st.sampled_from([shape[position]] * 3 + [1, shape[position] + 1]))
    shape = shape[draw(st.integers(0, len(shape))):] if draw(st.booleans()) else [draw(st.integers(1, 2)), *shape]
    if draw(st.integers(0, 4)) == 0:
        b: Any = draw(st.sampled_from([2, 0, -1.5, 0.0, math.inf, True]))
    else:
        b = draw(tensors(tuple(shape), dtypes=DTYPES))
    method = name + "_" if inplace else name
    return case(f"x.{method}(y)", lambda t, u: getattr(t, method)(u), a, b)


REDUCTIONS = ("sum", "mean", "prod", "amax", "amin", "max", "min", "argmax", "argmin", "logsumexp", "var", "std",
              "median", "nansum", "all", "any", "norm", "cumsum", "cumprod", "nanmedian", "aminmax", "mode")


@st.composite
def reductions(draw: Any) -> Case:
    name = draw(st.sampled_from(REDUCTIONS))
    x = draw(tensors(dtypes=DTYPES))
    ndim = len(x.shape)
    form = draw(st.sampled_from(["all", "dim", "dim", "dims"]))
    keepdim = draw(st.booleans())
    if form == "all" and name not in ("logsumexp", "cumsum", "cumprod", "mode"):
        return case(f"x.{name}()", lambda t: getattr(t, name)(), x)
    if form == "dims" and name in ("sum", "mean", "amax", "amin", "nansum", "var", "std", "logsumexp", "norm"):
        chosen = [_dim(draw, ndim) for _ in range(draw(st.integers(0, 3)))]
        return case(f"x.{name}({chosen}, keepdim={keepdim})", lambda t: getattr(t, name)(chosen, keepdim=keepdim), x)
    dim = _dim(draw, ndim)
    if name in ("cumsum", "cumprod"):
        return case(f"x.{name}({dim})", lambda t: getattr(t, name)(dim), x)
    if name == "aminmax":
        return case(f"x.aminmax(dim={dim}, keepdim={keepdim})", lambda t: t.aminmax(dim=dim, keepdim=keepdim), x)
    return case(f"x.{name}({dim}, keepdim={keepdim})", lambda t: getattr(t, name)(dim, keepdim=keepdim), x)


@st.composite
def huge(draw: Any) -> Case:
    """Sizes past any memory or past int64 elements: both devices must refuse, neither may try."""
    sizes = draw(st.lists(st.sampled_from(HUGE + (3, 0)), min_size=1, max_size=3).filter(
        lambda s: 0 not in s and math.prod(s) * 4 >= 2**44))
    form = draw(st.sampled_from(["empty", "zeros", "full", "randn", "arange", "new_ones", "expand then contiguous"]))
    x = draw(tensors((1,), dtypes=(torch.float32,), layouts=("contiguous",), special=False))
    calls = {"empty": lambda t: torch.empty(sizes), "zeros": lambda t: torch.zeros(sizes),
             "full": lambda t: torch.full(sizes, 2.5), "randn": lambda t: torch.randn(sizes),
             "arange": lambda t: torch.arange(math.prod(sizes[:2])), "new_ones": lambda t: t.new_ones(sizes),
             "expand then contiguous": lambda t: t.expand(sizes).contiguous()}
    return case(f"{form}({sizes})", calls[form], x)


PROPERTIES: dict[str, Callable[[], Any]] = {
    "index": index, "index_put_": index_put, "gather": gather, "scatter": scatter, "index_select": index_select,
    "index_add/copy/fill": index_add_copy_fill, "take/put_": take_put, "embedding": embedding,
    "nll_loss/cross_entropy": nll_cross_entropy, "one_hot": one_hot, "bincount": bincount,
    "repeat_interleave": repeat_interleave, "multinomial": multinomial, "binary_cross_entropy": binary_cross_entropy,
    "view/reshape": view_reshape, "expand": expand, "cat/stack": cat_stack, "narrow/select/slice": narrow_select,
    "dims": dims, "pointwise_unary": pointwise_unary, "pointwise_binary": pointwise_binary,
    "reductions": reductions, "huge": huge,
}


def explore(name: str, examples: int, run: Callable[[Case], None]) -> None:
    """Draw `examples` cases of one property, derandomized, and hand each to `run` (which must not raise)."""
    strategy = PROPERTIES[name]()

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def each(drawn: Case) -> None:
        run(drawn)

    each()

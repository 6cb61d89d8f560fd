"""The lowering table, one module per op family; importing this package fills it."""

from torch_pjrt.ops import (
    amp,  # noqa: F401
    conv,  # noqa: F401
    core,  # noqa: F401
    factories,  # noqa: F401
    fft,  # noqa: F401
    foreach,  # noqa: F401
    indexing,  # noqa: F401
    linalg,  # noqa: F401
    nn,  # noqa: F401
    optimizers,  # noqa: F401
    pointwise,  # noqa: F401
    prims,  # noqa: F401
    random,  # noqa: F401
    reductions,  # noqa: F401
    rnn,  # noqa: F401
    shape,  # noqa: F401
    sorting,  # noqa: F401
)
from torch_pjrt.ops.graph import lookup
from torch_pjrt.ops.registry import LOWERINGS, register

__all__ = ["LOWERINGS", "lookup", "register"]

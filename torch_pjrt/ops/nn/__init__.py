"""Neural-network ops: activations, norms, pooling, interpolation, embedding, losses, attention, padding.

Backward ops whose forward is a smooth composition (pads, interpolation, norms, average pooling,
most losses) are the jax vjp of the forward lowering, so forward and backward cannot disagree.
Trace-time index and weight tables are numpy constants. One module per family; `common` holds
what several share.
"""

from torch_pjrt.ops.nn import (
    activations,  # noqa: F401
    attention,  # noqa: F401
    distances,  # noqa: F401
    embedding,  # noqa: F401
    interpolation,  # noqa: F401
    losses,  # noqa: F401
    normalization,  # noqa: F401
    padding,  # noqa: F401
    pooling,  # noqa: F401
)

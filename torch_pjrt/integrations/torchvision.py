"""torchvision's Python parts on the CPU build of torch that pjrt runs on.

The torchvision wheels on PyPI for Linux are CUDA builds: their C++ extension (`_C.so`) needs
libc10_cuda.so and libtorch_cuda.so, which a CPU torch does not have. torchvision catches that load
failure and goes on without its C++ ops, but then registers fake kernels for `torchvision::nms` and
`torchvision::qnms` without checking, and `import torchvision` dies with "operator torchvision::nms does
not exist" (so do timm and every library importing it). Once `torchvision.extension` has failed to load
its ops, the two operators get their schemas (no kernel), so the import completes: models, transforms and
the pure-Python ops work, and calling a C++ op raises torchvision's own "Couldn't load custom C++ ops".
"""

from __future__ import annotations

from typing import Any

import torch

# The schemas of the two operators whose fake kernels torchvision registers unconditionally.
UNGUARDED_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor",
)
_library: list[torch.library.Library] = []


def define_missing_ops(extension: Any) -> None:
    """After `torchvision.extension` ran: if its C++ ops did not load, define the schemas its import needs."""
    if extension._has_ops() or _library:
        return
    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in UNGUARDED_SCHEMAS:
        if not hasattr(torch.ops.torchvision, schema.split("(", 1)[0]):
            library.define(schema)
    _library.append(library)

import gc
import os
from collections.abc import Iterator

os.environ.setdefault("TORCH_PJRT_CACHE_DIR", "0")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def backend_flags_settable() -> Iterator[None]:
    """PyTorch's test utilities (imported by the OpInfo tests) freeze torch.backends flags for the rest
    of their process; the user scripts our CLI tests run set them, as users do. With pytest-xdist the
    order of files in a worker varies, so every test gets them settable."""
    with getattr(torch.backends, "__allow_nonbracketed_mutation")():
        yield



@pytest.fixture
def settled_memory() -> Iterator[None]:
    """For tests that compare torch.pjrt.memory_allocated() exactly: garbage an earlier test left in a
    reference cycle is collected first and Python's collector stays off until the test ends, so no
    earlier test's tensor is freed between the two readings (CI saw one free 4,000 bytes mid-test)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()

"""Builds the optional native modules (metadata lives in pyproject.toml).

torch_pjrt._hooks needs the torch it will run with, so build with `pip install --no-build-isolation`; in an
isolated build (no torch) the package installs without it and uses the pure-Python path.
torch_pjrt._xla_cpu_kernels (XLA CPU custom calls) needs jaxlib's FFI headers only; without jaxlib at build
time the package installs without it and the paged-cache gathers stay XLA's own (kernels/paged.py).
"""

import importlib.util
import pathlib

from setuptools import Extension, setup

# torch_pjrt/csrc: the guard, hooks and tensors; the storages' DataPtrs and their link; the native dispatch;
# a compiled graph call's native replay (a module of its own, torch_pjrt._graph_call, in the same library)
CSRC_PARTS = ("hooks", "storage_link", "dispatch", "graph_call")


def xla_cpu_kernels() -> list[Extension]:
    """torch_pjrt._xla_cpu_kernels where jaxlib (with its FFI headers, xla/ffi/api/ffi.h) is installed."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return []
    include = pathlib.Path(next(iter(spec.submodule_search_locations))) / "include"
    if not (include / "xla" / "ffi" / "api" / "ffi.h").is_file():
        return []
    return [Extension("torch_pjrt._xla_cpu_kernels", ["torch_pjrt/csrc/xla_cpu_kernels.cpp"],
                      include_dirs=[str(include)], language="c++", extra_compile_args=["-O2", "-std=c++17"])]


try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    setup(ext_modules=xla_cpu_kernels())
else:
    setup(
        ext_modules=[CppExtension("torch_pjrt._hooks", [f"torch_pjrt/csrc/{part}.cpp" for part in CSRC_PARTS],
                                  extra_compile_args=["-O2"]), *xla_cpu_kernels()],
        cmdclass={"build_ext": BuildExtension},
    )

"""Builds the optional native module torch_pjrt._hooks (metadata lives in pyproject.toml).

It needs the torch it will run with, so build with `pip install --no-build-isolation`; in an
isolated build (no torch) the package installs without it and uses the pure-Python path.
"""

from setuptools import setup

# torch_pjrt/csrc: the guard, hooks and tensors; the storages' DataPtrs and their link; the native dispatch;
# a compiled graph call's native replay (a module of its own, torch_pjrt._graph_call, in the same library)
CSRC_PARTS = ("hooks", "storage_link", "dispatch", "graph_call")

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    setup()
else:
    setup(
        ext_modules=[CppExtension("torch_pjrt._hooks", [f"torch_pjrt/csrc/{part}.cpp" for part in CSRC_PARTS],
                                  extra_compile_args=["-O2"])],
        cmdclass={"build_ext": BuildExtension},
    )

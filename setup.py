"""Builds the optional native module torch_pjrt._hooks (metadata lives in pyproject.toml).

It needs the torch it will run with, so build with `pip install --no-build-isolation`; in an
isolated build (no torch) the package installs without it and uses the pure-Python path.
"""

from setuptools import setup

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    setup()
else:
    setup(
        ext_modules=[CppExtension("torch_pjrt._hooks", ["torch_pjrt/csrc/hooks.cpp", "torch_pjrt/csrc/dispatch.cpp"], extra_compile_args=["-O2"])],
        cmdclass={"build_ext": BuildExtension},
    )

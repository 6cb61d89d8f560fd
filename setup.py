"""Builds the optional native module torch_pjrt._hooks (metadata lives in pyproject.toml)."""

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[CppExtension("torch_pjrt._hooks", ["torch_pjrt/csrc/hooks.cpp"], extra_compile_args=["-O2"])],
    cmdclass={"build_ext": BuildExtension},
)

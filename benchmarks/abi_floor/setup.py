"""Builds the two do-nothing operators that `benchmarks/abi_compare.py` times beside fasthooks:
pip install --no-build-isolation --no-deps --target DIR benchmarks/abi_floor
"""

from pathlib import Path

from setuptools import setup
from torch.utils import cpp_extension

HERE = Path(__file__).parent
STABLE_ABI_TARGET = "-DTORCH_TARGET_VERSION=0x20a000000000000"  # torch 2.10, as setup.py

setup(
    name="abi-floor",
    ext_modules=[
        cpp_extension.CppExtension(
            "noop_stable",
            [str(HERE / "noop_stable.cpp")],
            extra_compile_args=["-O2", STABLE_ABI_TARGET],
            py_limited_api=True,
        ),
        cpp_extension.CppExtension(
            "noop_cpp_api", [str(HERE / "noop_cpp_api.cpp")], extra_compile_args=["-O2"]
        ),
    ],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
)

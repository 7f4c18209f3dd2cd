"""Build script: the pybind11 extension libra_ext._planner from cpp/ (C++17, -O3, warnings on, no math errno or FP traps)."""

from glob import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import find_namespace_packages, setup

# the sources compile in parallel, one job per core (LIBRA_BUILD_JOBS=N to choose)
ParallelCompile("LIBRA_BUILD_JOBS", default=0).install()

ext = Pybind11Extension(
    "libra_ext._planner",
    sorted(glob("cpp/src/*.cpp")) + ["cpp/bindings/module.cpp"],
    include_dirs=["cpp/include"],
    cxx_std=17,
    # no errno from math functions and no FP traps: lets the draw lengths' polynomials
    # vectorize (generators.cpp); neither changes a floating-point result
    extra_compile_args=["-O3", "-Wall", "-Wextra", "-fno-math-errno", "-fno-trapping-math"],
)

setup(
    packages=find_namespace_packages(
        include=["libra_ext", "libra_ext.*", "megatron.libra", "megatron.libra.*"]
    ),
    ext_modules=[ext],
    cmdclass={"build_ext": build_ext},
)

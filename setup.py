"""Build script: the Python package plus the native extension ``kvtier._C``.

``kvtier._C`` (pybind11) is built by CMake from ``hip/`` (host runtime + bindings). The
Triton kernel bodies in ``triton_kernels/`` are installed as ``kvtier.triton_kernels``.

Build toggles (read here and nowhere else):
  KVTIER_BUILD_TYPE   CMake build type, default ``Release``.
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    """An extension whose sources are listed in CMakeLists.txt, built as CMake target ``target``."""

    def __init__(self, name: str, target: str):
        super().__init__(name, sources=[])
        self.target = target


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / ext.target
        build_dir.mkdir(parents=True, exist_ok=True)
        config = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            f"-DCMAKE_BUILD_TYPE={os.environ.get('KVTIER_BUILD_TYPE', 'Release')}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DKVTIER_PYTHON_OUTPUT_DIR={out_dir}",
            "-DKVTIER_BUILD_TESTS=OFF",
        ]
        subprocess.run(config, check=True)
        jobs = str(os.cpu_count() or 2)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", ext.target, "-j", jobs], check=True)


setup(
    packages=find_packages("python") + ["kvtier.triton_kernels"],
    package_dir={"": "python", "kvtier.triton_kernels": "triton_kernels"},
    package_data={"kvtier": ["py.typed"], "kvtier.triton_kernels": ["configs/*.json"]},
    ext_modules=[
        # Host runtime: block hash, prefix index, copy engine, disk tier, token buffer.
        CMakeExtension("kvtier._C", target="kvtier_C"),
    ],
    cmdclass={"build_ext": CMakeBuild},
)

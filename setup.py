"""Build script: the Python package plus the native extensions ``kvtier._C`` and ``kvtier._hip``.

Both are built by CMake from ``hip/`` (source lists in CMakeLists.txt): ``kvtier._C`` (pybind11)
is the host runtime and the CPU implementations of the GPU kernels, always built;
``kvtier._hip`` (pybind11) is the GPU kernels, built only where CMake finds a GPU compiler with a
GPU driver (hipcc and /dev/kfd, or nvcc and the NVIDIA driver); otherwise the build says why
and goes on without it (``backend="hip"`` then reports itself unavailable). The Triton kernel
bodies in ``triton_kernels/`` are installed as ``kvtier.triton_kernels``.

Build toggles (read here and nowhere else):
  KVTIER_BUILD_TYPE   CMake build type, default ``Release``.
  KVTIER_BUILD_HIP    ``auto`` (default), ``on`` (build kvtier._hip with whichever GPU compiler is
                      found, even without a driver; fail without one) or ``off``.
"""

import os
import shutil
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
    """Configure CMake once for all extensions; build only the targets CMake enabled."""

    def run(self) -> None:
        self._build_dir = self._configure()
        status = (self._build_dir / "kvtier_hip_status.txt").read_text().strip()
        if not status.startswith("ON"):
            print(f"kvtier._hip is not built: {status}")
            self.extensions = [ext for ext in self.extensions if ext.name != "kvtier._hip"]
        super().run()

    def _configure(self) -> Path:
        import pybind11

        hip = os.environ.get("KVTIER_BUILD_HIP", "auto").upper()
        if hip not in ("AUTO", "ON", "OFF"):
            raise SystemExit(f"KVTIER_BUILD_HIP must be auto, on or off, got {hip.lower()!r}")
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        config = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            f"-DCMAKE_BUILD_TYPE={os.environ.get('KVTIER_BUILD_TYPE', 'Release')}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DKVTIER_PYTHON_OUTPUT_DIR={build_dir / 'python'}",
            f"-DKVTIER_BUILD_HIP={hip}",
            "-DKVTIER_BUILD_TESTS=OFF",
        ]
        subprocess.run(config, check=True)
        return build_dir

    def build_extension(self, ext: CMakeExtension) -> None:
        jobs = str(os.cpu_count() or 2)
        subprocess.run(["cmake", "--build", str(self._build_dir), "--target", ext.target, "-j", jobs], check=True)
        dest = Path(self.get_ext_fullpath(ext.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self._build_dir / "python" / dest.name, dest)


setup(
    packages=find_packages("python") + ["kvtier.triton_kernels"],
    package_dir={"": "python", "kvtier.triton_kernels": "triton_kernels"},
    package_data={"kvtier": ["py.typed"], "kvtier.triton_kernels": ["configs/*.json"],
                  "kvtier.sim": ["*.toml"]},  # the simulator's hardware and scenarios
    ext_modules=[
        # Host runtime (block hash, prefix index, copy engine, disk tier, token buffer) and the CPU
        # implementations of the GPU kernels (hip/cpu).
        CMakeExtension("kvtier._C", target="kvtier_C"),
        # GPU kernels (hip/kernels: page copy, paged MLA decode, moe_align_block_size), where a GPU
        # compiler and driver are present.
        CMakeExtension("kvtier._hip", target="kvtier_hip"),
    ],
    cmdclass={"build_ext": CMakeBuild},
)

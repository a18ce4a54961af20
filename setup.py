"""Builds minfer and its CUDA extension minfer._C from csrc/.

Architectures: TORCH_CUDA_ARCH_LIST when set; else the GPU present (Hopper gets sm_90a, which
wgmma needs); else sm_80 + sm_90a. With no nvcc (or a CPU-only torch) the extension is skipped
with a one-line notice and minfer runs on its reference backend.
"""
import glob
import os
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _arch_list(torch):
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}a" if major == 9 else f"{major}.{minor}"
    return "8.0;9.0a"


def _extensions():
    if os.environ.get("MINFER_SKIP_EXTENSION"):  # setup.sh builds it in place first
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        print("minfer: torch is not installed; skipping the CUDA extension", file=sys.stderr)
        return [], {}
    if CUDA_HOME is None or torch.version.cuda is None:
        if os.environ.get("MINFER_REQUIRE_EXTENSION"):
            raise SystemExit("minfer: MINFER_REQUIRE_EXTENSION is set but there is no nvcc or torch has no CUDA")
        print("minfer: no nvcc or CPU-only torch; skipping the CUDA extension (reference backend only)", file=sys.stderr)
        return [], {}
    os.environ["TORCH_CUDA_ARCH_LIST"] = _arch_list(torch)
    print(f"minfer: building for TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}", file=sys.stderr)
    sources = sorted(glob.glob("csrc/**/*.cu", recursive=True) + glob.glob("csrc/**/*.cpp", recursive=True))
    nvcc_flags = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo",
                  "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                  "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__"]
    ext = CUDAExtension(
        name="minfer._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": ["-O3", "-std=c++20"], "nvcc": nvcc_flags},
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)

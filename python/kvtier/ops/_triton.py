"""Helpers shared by the Triton launchers (imported only when a Triton backend is resolved).

- :func:`launchable` returns the kernel to launch: the compiled ``@triton.jit`` function for GPU
  tensors, an interpreted copy of its body for CPU tensors. Triton decides interpreted-vs-compiled
  when a function is decorated; deciding here at launch makes our kernels independent of import
  order, but triton's own library (``tl.sum``, ``tl.cdiv``) is fixed when triton is first imported,
  so ``TRITON_INTERPRET=1`` must be set before that (``tests/conftest.py`` does it on CPU-only
  machines; the dispatcher reports the backend unavailable otherwise).
- :func:`arch_of` names a device's architecture (``"sm_90"``, ``"gfx942"``; ``"cpu"``), the key of
  per-arch launch configurations.
- :func:`triton_dot_dtype` picks the dtype that ``tl.dot`` consumes.
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from kvtier.ops.dispatch import _interpreter_unready
from kvtier.ops.split_kv import num_compute_units  # noqa: F401 (re-exported for the launchers)


@functools.cache
def _interpreted(kernel):
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(kernel.fn)


def launchable(kernel, device: torch.device):
    """``kernel`` itself for GPU tensors; its interpreted body for CPU tensors under the interpreter."""
    if device.type == "cpu":
        reason = _interpreter_unready()
        if reason is not None:
            raise RuntimeError(reason)
        return _interpreted(kernel)
    return kernel


def arch_of(device: torch.device) -> str:
    """``"sm_XY"`` (NVIDIA), ``"gfxNNN"`` (AMD) or ``"cpu"``."""
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip is not None:
        return props.gcnArchName.split(":")[0]
    return f"sm_{props.major}{props.minor}"


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def triton_dot_dtype(dtype: torch.dtype, device: torch.device):
    """The dtype ``tl.dot`` consumes for ``dtype`` inputs: the input's own 16-bit dtype on a GPU
    (fp32 accumulation), fp32 for fp32 inputs (IEEE, not TF32) and always under the interpreter,
    whose bf16/fp16 arithmetic is not faithful."""
    if device.type == "cpu" or dtype == torch.float32:
        return tl.float32
    return _TL_DTYPES[dtype]

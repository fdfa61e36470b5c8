"""Triton kernel bodies (``@triton.jit`` only), installed as ``kvtier.triton_kernels``.

Public wrappers live in :mod:`kvtier.ops`; callers never import these bodies directly.
"""

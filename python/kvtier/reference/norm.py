"""RMSNorm reference. Bytes: read x + weight, write out (``2*T*D + D`` elements). FLOPs ~ ``4*T*D``."""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x**2, -1) + eps)``, computed in fp32, returned in ``x.dtype``.

    The weight is applied after casting the normalised value back to ``x.dtype`` (the
    transformers DeepSeek-V3 order). x: [..., D]; weight: [D].
    """
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))).to(x.dtype)
    if weight.dtype == x.dtype:
        # torch multiplies bf16/fp16 tensors in fp32 and rounds once: the product of two such
        # values is exact in fp32, so this equals the upcast form below bit for bit, in 2 ops
        # fewer (half the time at 8 x 256 on one core)
        return normed * weight
    return (weight.float() * normed.float()).to(x.dtype)

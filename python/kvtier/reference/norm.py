"""RMSNorm reference. Bytes: read x + weight, write out (``2*T*D + D`` elements). FLOPs ~ ``4*T*D``."""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x**2, -1) + eps)``, computed in fp32, returned in ``x.dtype``.

    The weight is applied after casting the normalised value back to ``x.dtype`` (the
    transformers DeepSeek-V3 order). x: [..., D]; weight: [D].
    """
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed.to(x.dtype).float()).to(x.dtype)

"""Gated activations of the MoE and MLP layers: SiLU-GLU and SiTU-GLU.

Bytes: read ``T*2I``, write ``T*I`` elements. FLOPs ~ ``4*T*I`` (SiLU), ~ ``8*T*I`` (SiTU).

SiTU-GLU (Kimi K3, ``hidden_act: situ``): ``beta * tanh(gate / beta) * sigmoid(gate) * up'`` with
``up' = linear_beta * tanh(up / linear_beta)``, or ``up`` itself when ``linear_beta`` is None.
Source: the vllm package's ``vllm/model_executor/layers/activation.py`` (``SituAndMul``), which
``vllm/models/kimi_k3`` uses for ``hidden_act: situ`` with ``activation_situ_beta`` (4.0 for K3)
and ``activation_situ_linear_beta`` (25.0); Kimi K3 report (arXiv 2607.24653).
"""

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "situ")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*I] = [gate | up] -> ``silu(gate) * up`` [..., I], fp32 math, ``x.dtype`` out."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def gated_act(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", beta: float = 1.0,
              linear_beta: float | None = None) -> torch.Tensor:
    """The gated product of two float tensors of one shape, in their dtype (callers pass fp32):
    ``silu(gate) * up`` or SiTU-GLU (module docstring). ``beta`` and ``linear_beta`` are used by
    ``situ`` only."""
    if activation == "silu":
        return F.silu(gate) * up
    if activation != "situ":
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    g = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    if linear_beta is not None:
        up = linear_beta * torch.tanh(up / linear_beta)
    return g * up


def situ_and_mul(x: torch.Tensor, beta: float = 1.0, linear_beta: float | None = None) -> torch.Tensor:
    """x: [..., 2*I] = [gate | up] -> SiTU-GLU [..., I] (module docstring), fp32 math, ``x.dtype`` out."""
    gate, up = x.float().chunk(2, dim=-1)
    return gated_act(gate, up, "situ", beta, linear_beta).to(x.dtype)

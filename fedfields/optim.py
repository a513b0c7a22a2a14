"""The device and optimiser every training loop starts from: centralised, federated and split."""

from __future__ import annotations

import torch
from torch import nn


def resolve_device(device: str) -> torch.device:
    """'auto' means CUDA when a device is present, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def make_optimizer(
    module: nn.Module, learning_rate: float, weight_decay: float
) -> torch.optim.Adam:
    """Adam with eps 1e-15; weight decay on 2-D MLP weights only (not hash tables or biases)."""
    decayed, plain = [], []
    for name, parameter in module.named_parameters():
        is_mlp_weight = parameter.ndim == 2 and not name.endswith("table")
        (decayed if is_mlp_weight else plain).append(parameter)
    groups = [
        {"params": decayed, "weight_decay": weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]
    return torch.optim.Adam(groups, lr=learning_rate, betas=(0.9, 0.99), eps=1e-15)

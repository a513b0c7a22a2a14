"""The optimiser every training loop starts from: centralised, federated and split."""

from __future__ import annotations

import torch
from torch import nn


def adam_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Parameter groups: weight decay on 2-D MLP weights only (not hash tables or biases)."""
    decayed, plain = [], []
    for name, parameter in module.named_parameters():
        is_mlp_weight = parameter.ndim == 2 and not name.endswith("table")
        (decayed if is_mlp_weight else plain).append(parameter)
    return [
        {"params": decayed, "weight_decay": weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]


def make_optimizer(
    module: nn.Module, learning_rate: float, weight_decay: float
) -> torch.optim.Adam:
    """Adam with eps 1e-15 over `adam_groups`."""
    groups = adam_groups(module, weight_decay)
    return torch.optim.Adam(groups, lr=learning_rate, betas=(0.9, 0.99), eps=1e-15)

"""FLOP accounting of dense layers and a matmul peak to compare achieved throughput with."""

from __future__ import annotations

import time

import torch
from torch import nn


def linear_flops_per_sample(module: nn.Module) -> int:
    """Forward multiply-add FLOPs (2 * in * out) of every nn.Linear in `module`, per sample."""
    return sum(
        2 * layer.in_features * layer.out_features
        for layer in module.modules()
        if isinstance(layer, nn.Linear)
    )


def matmul_peak_flops(size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a large float32 torch.matmul on this machine: the practical peak."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.matmul(a, b)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.matmul(a, b)
    seconds = (time.perf_counter() - start) / repeats
    return 2.0 * size**3 / seconds

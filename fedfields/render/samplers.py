"""Samples along rays: stratified (NeRF), hierarchical resampling, occupancy-grid marching."""

from __future__ import annotations

import torch
from torch import Tensor


def stratified_bins(t_near: Tensor, t_far: Tensor, num_samples: int, perturb: bool) -> Tensor:
    """Bin edges [R, S+1] splitting [t_near, t_far] evenly; jittered edges when `perturb`."""
    steps = torch.linspace(0.0, 1.0, num_samples + 1, device=t_near.device)
    edges = t_near[:, None] + (t_far - t_near)[:, None] * steps
    if perturb:
        width = (t_far - t_near)[:, None] / num_samples
        jitter = (torch.rand(edges.shape[0], num_samples, device=edges.device) - 0.5) * width
        inner = edges[:, 1:-1] + jitter[:, 1:]
        edges = torch.cat([edges[:, :1], inner.clamp_min(edges[:, :1]), edges[:, -1:]], dim=-1)
        edges = torch.sort(edges, dim=-1).values
    return edges


def importance_bins(edges: Tensor, weights: Tensor, num_samples: int, perturb: bool) -> Tensor:
    """Hierarchical resampling: draw `num_samples` from the piecewise-constant pdf of `weights`
    over bins `edges` [R, S+1] (NeRF Sec. 5.2) and merge them with the coarse edges.
    """
    pdf = (weights + 1e-5) / (weights + 1e-5).sum(-1, keepdim=True)
    cdf = torch.cat([torch.zeros_like(pdf[:, :1]), torch.cumsum(pdf, -1)], dim=-1)
    if perturb:
        u = torch.rand(cdf.shape[0], num_samples, device=cdf.device)
    else:
        u = torch.linspace(0.0, 1.0, num_samples, device=cdf.device)
        u = u.expand(cdf.shape[0], num_samples)
    u = u.contiguous() * (1.0 - 1e-6)
    upper = torch.searchsorted(cdf, u, right=True).clamp(1, cdf.shape[-1] - 1)
    lower = upper - 1
    cdf_lo, cdf_hi = cdf.gather(-1, lower), cdf.gather(-1, upper)
    edge_lo, edge_hi = edges.gather(-1, lower), edges.gather(-1, upper)
    fraction = ((u - cdf_lo) / (cdf_hi - cdf_lo).clamp_min(1e-8)).clamp(0.0, 1.0)
    new_edges = edge_lo + fraction * (edge_hi - edge_lo)
    return torch.sort(torch.cat([edges, new_edges.detach()], dim=-1), dim=-1).values

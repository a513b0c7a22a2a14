"""Per-round server FLOPs and traffic of each aggregation rule (DecentNeRF appendix B.2).

Convention of B.2: summing N client vectors of d values costs d*N FLOPs ("1 addition is
equivalent to 1 FLOP"); O(d) finishing steps (dividing by the weight sum, adding a scaled
mean) are not counted. Bytes are totals over the N clients of one round, every value
(scalar weights included) at `bytes_per_value`, without secure-aggregation overhead;
DecentNeRF figures are for a round m > 1, which also exchanges gradients.

Server FLOPs (d = num_parameters, N = num_clients):
  the mean's methods d*N        weighted sum of the states (a method's own records add theirs)
  decentnerf         (2d+1)*N   ours: sum of alpha_k g_k with alpha_k, plus sum of G_k; the
                                clients compute <G, g_k> themselves
  decentnerf_paper   4*d*N      B.2: weights d*N + gradients d*N + dot products 2*d*N
Secure aggregation adds `secagg_reconstruction_flops` per securely summed vector.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RoundCost:
    """Server FLOPs and total client->server / server->client bytes of one round."""

    server_flops: int
    uplink_bytes: int
    downlink_bytes: int


@dataclass(frozen=True)
class CostModel:
    """One aggregation rule's per-round costs as linear functions of d and N (table above).

    Server FLOPs (flops_per_value * d + flops_per_client) * N; values each client sends up
    up_per_value * d + up_extra, and receives down_per_value * d.
    """

    flops_per_value: int
    flops_per_client: int
    up_per_value: int
    up_extra: int
    down_per_value: int

    def round_cost(
        self, num_parameters: int, num_clients: int, bytes_per_value: int = 4
    ) -> RoundCost:
        """Server FLOPs and traffic of one round with d parameters and N clients."""
        for name, value, least in (
            ("num_parameters", num_parameters, 1),
            ("num_clients", num_clients, 0),  # a round whose replies all failed costs nothing
            ("bytes_per_value", bytes_per_value, 1),
        ):
            if int(value) != value or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value}")
        d, n = int(num_parameters), int(num_clients)
        return RoundCost(
            server_flops=(self.flops_per_value * d + self.flops_per_client) * n,
            uplink_bytes=n * (self.up_per_value * d + self.up_extra) * bytes_per_value,
            downlink_bytes=n * self.down_per_value * d * bytes_per_value,
        )


FEDAVG_COST = CostModel(1, 0, 1, 1, 1)
"""FedAvg and every method on its records: up the state and the example count, down the
state. A method with other records declares its own `CostModel` in its module."""
DECENTNERF_COST = CostModel(2, 1, 2, 1, 2)
"""DecentNeRF as fedfields runs it: up G_k, alpha_k g_k and alpha_k; down g^(m-1) and G."""
DECENTNERF_PAPER_COST = CostModel(4, 0, 2, 0, 2)
"""DecentNeRF as appendix B.2 counts it (the server also computes the dot products)."""


def secagg_reconstruction_flops(num_values: int, num_clients: int) -> int:
    """SecAgg+ reconstruction of one secure sum, d*N*ceil(log2 N) for its O(dN log N) (B.2).

    With d = 1e6, N = 20 and 30 rounds this gives B.2's 3e9 FLOPs.
    """
    if num_values < 1 or num_clients < 1:
        raise ValueError(f"need positive sizes, got d={num_values}, N={num_clients}")
    return num_values * num_clients * math.ceil(math.log2(num_clients))


def centralised_cost(
    num_pixels: int, epochs: int, flops_per_batch: float = 350e6, rays_per_batch: int = 4096
) -> int:
    """Server FLOPs of training NeRF-W centrally: batches per epoch * FLOPs per batch * epochs.

    B.2: 350e6 FLOPs per 4096-ray batch (Mueller et al.), 12,500 batches, 30 epochs ~ 130e12.
    """
    if num_pixels < 1 or epochs < 1 or rays_per_batch < 1 or not flops_per_batch > 0:
        raise ValueError("num_pixels, epochs, rays_per_batch and flops_per_batch must be > 0")
    return round(math.ceil(num_pixels / rays_per_batch) * flops_per_batch * epochs)

"""FedMeNF's server (FedMeNF paper, Algorithm 1): M of N clients per round, size-weighted mean.

The server of federated meta-learning is FedAvg's: theta <- sum_m |D_m| / sum_i |D_i| w_m over
the M sampled clients' local meta-learners w_m (Eq. 2). What makes it FedMeNF is the clients'
privacy-preserving local loss (`fedfields.train.meta`), not the aggregation.
"""

from __future__ import annotations

from typing import Unpack

from strategies.base import StrategyOptions
from strategies.fedavg import FedAvg


def m_of_n_sampling(clients_per_round: int, num_clients: int) -> StrategyOptions:
    """Flower sampling arguments that pick exactly M of N connected nodes each round.

    Flower's FedAvg samples max(int(N * fraction_train), min_train_nodes) nodes once
    `min_available_nodes` are connected; fraction M/N with a floor of M gives M.
    """
    for name, value in (("clients_per_round", clients_per_round), ("num_clients", num_clients)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if clients_per_round > num_clients:
        raise ValueError(
            f"clients_per_round ({clients_per_round}) exceeds num_clients ({num_clients})"
        )
    return {
        "fraction_train": clients_per_round / num_clients,
        "min_train_nodes": clients_per_round,
        "min_available_nodes": num_clients,
    }


class FedMeNF(FedAvg):
    """FedMeNF aggregation: M of N nodes per round, theta = sum_m |D_m| w_m / sum_m |D_m|.

    |D_m| is the reply's "num-examples" (the client's dataset size); messages and replies are
    FedAvg's (`strategies.FedAvg`), with "strategy" = "fedmenf" in the train config.

    Args:
        clients_per_round: M, the clients sampled each round.
        num_clients: N, the nodes sampling waits for.
        fraction_evaluate, min_evaluate_nodes, local_steps: as for `strategies.FedAvg`.
    """

    strategy_name = "fedmenf"

    def __init__(
        self,
        *,
        clients_per_round: int,
        num_clients: int,
        **options: Unpack[StrategyOptions],
    ) -> None:
        sampling = m_of_n_sampling(clients_per_round, num_clients)
        if clashes := sorted(set(sampling) & set(options)):
            raise ValueError(f"FedMeNF sets {clashes} from clients_per_round and num_clients")
        super().__init__(**sampling, **options)

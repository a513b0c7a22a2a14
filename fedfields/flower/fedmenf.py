"""FedMeNF (FedMeNF paper, Algorithm 1) on Flower: the server's method
(`fedfields.methods.fedmenf`, the size-weighted mean) sampling M of N nodes a round, and the
client's LocalUpdate as a Flower train reply's parts (`meta_train_parts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Unpack

from flwr.app import Message, RecordDict
from torch import nn

from fedfields.flower.client_hooks import keep_results, received_hooks
from fedfields.flower.node import NodeState
from fedfields.flower.protocol import (
    ARRAYS,
    CONFIG,
    LOCAL_STEPS,
    NUM_EXAMPLES,
    TRAIN_LOSS,
    TRAIN_STEPS,
    ReplyParts,
    arrays_to_state,
    state_to_arrays,
)
from fedfields.flower.strategy import MethodOptions, StrategyOptions, method_strategy
from fedfields.methods import fedmenf
from fedfields.train.federated import load_federated_state
from fedfields.train.meta import MetaConfig, local_meta_update
from fedfields.train.meta_tasks import MetaTask

GAMMA = "gamma"
"""Reply metric: FedMeNF's mean gamma over the round's outer steps (adaptive or fixed)."""


def m_of_n_sampling(
    clients_per_round: int, num_clients: int, min_available_nodes: int | None = None
) -> StrategyOptions:
    """Flower sampling arguments that pick exactly M of N connected nodes each round.

    Flower's FedAvg samples max(int(N * fraction_train), min_train_nodes) nodes once
    `min_available_nodes` are connected (default: all N); fraction M/N with a floor of M
    gives M.
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
        "min_available_nodes": num_clients if min_available_nodes is None else min_available_nodes,
    }


class FedMeNF(method_strategy(fedmenf.FedMeNF)):  # type: ignore[misc]
    """FedMeNF aggregation: M of N nodes per round, theta = sum_m |D_m| w_m / sum_m |D_m|.

    |D_m| is the reply's "num-examples" (the client's dataset size); messages and replies are
    FedAvg's (`fedfields.flower.FedAvg`), with "strategy" = "fedmenf" in the train config.

    Args:
        clients_per_round: M, the clients sampled each round.
        num_clients: N, the nodes the first round waits for (unless `min_available_nodes`).
        min_available_nodes: the nodes the first round waits for instead of N.
        fraction_evaluate, min_evaluate_nodes, local_steps, aggregation_rule, trim_fraction,
            num_malicious, krum_select, max_num_examples, max_update_norm: as for
            `fedfields.flower.FedAvg` (a robust `aggregation_rule` replaces the size-weighted
            mean of the w_m).
    """

    def __init__(
        self,
        *,
        clients_per_round: int,
        num_clients: int,
        min_available_nodes: int | None = None,
        **options: Unpack[MethodOptions],
    ) -> None:
        sampling = m_of_n_sampling(clients_per_round, num_clients, min_available_nodes)
        if clashes := sorted(set(sampling) & set(options)):
            raise ValueError(f"FedMeNF sets {clashes} from clients_per_round and num_clients")
        super().__init__(**sampling, **options)


def meta_train_parts(
    msg: Message, model: nn.Module, tasks: Sequence[MetaTask], meta: MetaConfig, state: NodeState
) -> ReplyParts:
    """One client's LocalUpdate from the received theta, as a train reply's parts: w_E (ARRAYS)
    and |D|, the mean outer loss and gamma (METRICS); `.message(msg)` makes the reply, after an
    app has added its own metrics in one place.

    The message may override E ("local-steps"); the client runs the hooks of the method the
    message names (`fedfields.flower.client_hooks`: a loss term, a control variate whose
    c_i+ is the round's mean outer gradient) and adds what they leave to the reply.
    """
    round_config = msg.content[CONFIG]
    theta = arrays_to_state(msg.content[ARRAYS])
    load_federated_state(model, theta)
    meta = dataclasses.replace(
        meta, outer_steps=int(round_config.get(LOCAL_STEPS, meta.outer_steps))
    )
    result = local_meta_update(model, tasks, meta, received_hooks(msg, state))
    metrics = {
        NUM_EXAMPLES: result.num_examples,
        TRAIN_LOSS: sum(result.outer_losses) / len(result.outer_losses),
        TRAIN_STEPS: meta.outer_steps,
    }
    if result.gammas:
        metrics[GAMMA] = sum(result.gammas) / len(result.gammas)
    records = RecordDict({ARRAYS: state_to_arrays(result.state)})
    keep_results(result.hook_results, records, state)
    return ReplyParts(records, metrics)

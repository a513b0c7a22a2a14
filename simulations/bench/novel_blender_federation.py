"""The Novel Blender bench's federated methods through the library's round.

FedNeRF is `fedfields.flower.FedAvg`, DecentNeRF(-L) and DecentNeRF are
`fedfields.flower.DecentNeRF` (alpha-lr 0 freezes each user's weight), each run by its
`start` loop over an in-process grid (`simulations.in_process_grid`) whose nodes are the
crowd's users: the strategies, their `Round` (gate -> sum -> ledger) and the nodes' `reply_parts`
are the code the App runs, without Ray's per-message overhead. A node keeps its personal field
and occupancy grid in this process (its memory) and trains in one field shared by the nodes,
which run one after another. What the bench scores on a node (Fig. 7: an upload's or a user's
own fields inside the personal masks) is read there, before its reply leaves; the server
field is scored in `round_end_fn` from each round's outcome.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MessageType
from torch import Tensor

from fedfields.config import FederatedConfig
from fedfields.data.crowd import CrowdData, CrowdUser
from fedfields.fields import Field
from fedfields.fields.personal import PersonalField
from fedfields.flower import (
    DecentNeRF,
    DecentNeRFClient,
    FedAvg,
    NodeState,
    answer_gradient_query,
    reply_parts,
)
from fedfields.flower.node import answer_user_key
from fedfields.flower.protocol import (
    ARRAYS,
    CONFIG,
    GRADIENT_QUERY,
    SERVER_ROUND,
    USER_KEY_MESSAGE_TYPE,
    arrays_to_state,
    state_to_arrays,
)
from fedfields.flower.round import RoundOutcome
from fedfields.flower.strategy import ProtocolStrategy
from fedfields.render import OccupancyGrid
from fedfields.train.builders import global_field
from fedfields.train.federated import (
    StepGraphs,
    federated_state,
    load_federated_state,
    local_train,
    loss_gradient,
)
from simulations.bench.novel_blender_setup import (
    Settings,
    eval_views,
    personal_field,
    personal_psnr,
    render,
    render_config,
    score_server_field,
)
from simulations.in_process_grid import InProcessGrid


@dataclass
class Workbench:
    """What the nodes and the server of one bench run share in this process: the field the
    nodes train in, the settings, and what the nodes observed in the current round."""

    model: Field
    config: FederatedConfig
    settings: Settings
    personal_fields: bool
    observed: dict[str, list[float]] = field(default_factory=dict)
    train_seconds: float = 0.0
    rays: int = 0  # rays the local steps drew, every node and round
    dropped_rays: int = 0  # of them, left out of a static step's loss (overflow)
    graphs: StepGraphs = field(default_factory=StepGraphs)  # static steps' graphs, all nodes

    def observe(self, key: str, value: float) -> None:
        """Note one node's figure under `key` for this round's record."""
        self.observed.setdefault(key, []).append(value)


@dataclass
class CrowdNode:
    """One crowd user as a Flower node: answers the user-key query, DecentNeRF's gradient
    query and train messages; its personal field and occupancy grid never leave it."""

    bench: Workbench
    index: int
    user: CrowdUser
    view: int  # the view the bench scores every round
    personal: PersonalField | None
    occupancy: OccupancyGrid

    def __call__(self, msg: Message, context: Context) -> Message:
        """The reply to `msg`, by its message type."""
        kind = msg.metadata.message_type
        if kind == USER_KEY_MESSAGE_TYPE:
            return answer_user_key(msg, context)
        if kind == GRADIENT_QUERY:
            return answer_gradient_query(msg, self.gradient_at(msg))
        if kind == MessageType.TRAIN:
            return self.train(msg, context)
        raise ValueError(f"bench node {self.index}: no handler for message type {kind!r}")

    def gradient_at(self, msg: Message) -> Callable[[dict[str, Tensor]], dict[str, Tensor]]:
        """G_k at a received global field: the user's loss gradient, both fields frozen."""
        bench, server_round = self.bench, int(msg.content[CONFIG][SERVER_ROUND])

        def gradient(received: dict[str, Tensor]) -> dict[str, Tensor]:
            load_federated_state(bench.model, received)
            return loss_gradient(
                bench.model,
                self.user.scene,
                render_config(bench.config, self.user.scene),
                self.occupancy,
                self.personal,
                bench.settings.gradient_rays,
                seed=server_round,
                beta_min=bench.settings.beta_min,
                device=bench.settings.device,
            )

        return gradient

    def train(self, msg: Message, context: Context) -> Message:
        """Train from the received global field, score what the server (or the user) reads,
        reply as the message's method asks (`reply_parts`): FedAvg's state and num-examples,
        or DecentNeRF's alpha-weighted payload."""
        bench, scene = self.bench, self.user.scene
        server_round = int(msg.content[CONFIG][SERVER_ROUND])
        load_federated_state(bench.model, arrays_to_state(msg.content[ARRAYS]))
        local = bench.settings.local(server_round, self.index, bench.personal_fields)
        tick = time.perf_counter()
        result = local_train(bench.model, scene, local, render_config(bench.config, scene),
                             self.occupancy, personal_field=self.personal,
                             graphs=bench.graphs)  # fmt: skip
        bench.train_seconds += time.perf_counter() - tick
        bench.rays += result.rays
        bench.dropped_rays += result.dropped_rays
        upload = federated_state(bench.model)
        self.score_fields()
        return reply_parts(msg, NodeState(context), upload, {}, result.num_examples).message(msg)

    def score_fields(self) -> None:
        """Personal-content PSNR of the trained global field (FedNeRF: the plaintext upload
        the server reads) and, with a personal field, of that field alone (Fig. 7b)."""
        bench, view = self.bench, self.view
        bench.model.eval()
        image = render(bench.model, self.user.scene, view, bench.config, self.occupancy)
        if self.personal is None:
            bench.observe("upload-personal-psnr", personal_psnr(image, self.user, view))
        else:
            bench.observe("own-global-personal-psnr", personal_psnr(image, self.user, view))
            own = render(self.personal, self.user.scene, view, bench.config, self.occupancy)
            bench.observe("own-personal-personal-psnr", personal_psnr(own, self.user, view))
        bench.model.train()


def strategy_for(method: str, settings: Settings, num_users: int) -> ProtocolStrategy:
    """Every user every round, no federated evaluation: FedAvg for FedNeRF, DecentNeRF for
    the others (alpha-lr 0 for DecentNeRF(-L): the weights stay as they start)."""
    options: dict[str, Any] = dict(fraction_train=1.0, fraction_evaluate=0.0,
                                   min_train_nodes=num_users, min_available_nodes=num_users,
                                   sampling_seed=settings.seed, sample_by_user=True)  # fmt: skip
    if method == "fednerf":
        return FedAvg(**options)
    alpha_lr = settings.alpha_lr if method == "decentnerf" else 0.0
    return DecentNeRF(alpha_lr=alpha_lr, **options)


def round_record(observed: dict[str, list[float]]) -> dict[str, float]:
    """The round's node figures: mean upload leakage and its worst user, mean own-field ones."""
    record: dict[str, float] = {}
    if upload := observed.get("upload-personal-psnr"):
        record["upload-personal-psnr"] = float(np.mean(upload))
        record["upload-personal-psnr-max-user"] = float(np.max(upload))
    for key in ("own-global-personal-psnr", "own-personal-personal-psnr"):
        if values := observed.get(key):
            record[key] = float(np.mean(values))
    return record


def run_federated(
    method: str, data: CrowdData, config: FederatedConfig, settings: Settings
) -> dict[str, Any]:
    """One federated method for `settings.rounds` rounds with every user; history and scores."""
    personal_fields = method != "fednerf"
    torch.manual_seed(settings.seed)
    model = global_field(config)
    bench = Workbench(model, config, settings, personal_fields)
    views = eval_views(data)
    nodes = [
        CrowdNode(
            bench,
            index,
            user,
            view=views[index][1],
            personal=personal_field(len(user.scene), model.aabb) if personal_fields else None,
            occupancy=OccupancyGrid(model.aabb),
        )
        for index, user in enumerate(data.users)
    ]
    grid = InProcessGrid(nodes, raise_errors=True)
    clients = [DecentNeRFClient(NodeState(context)) for context in grid.contexts.values()]
    if method == "decentnerf-l" and settings.fixed_alphas is not None:
        for client, alpha in zip(clients, settings.fixed_alphas, strict=True):
            client.keep_alpha(alpha)
    history: list[dict[str, Any]] = []
    started = time.perf_counter()

    def score_round(outcome: RoundOutcome, arrays: ArrayRecord) -> None:
        """The server field's scores after the round, with what the nodes observed."""
        load_federated_state(model, arrays_to_state(arrays))
        model.eval()
        record: dict[str, Any] = {"round": outcome.server_round}
        record.update(score_server_field(model, data, config, views))
        model.train()
        record.update(round_record(bench.observed))
        bench.observed.clear()
        record["alphas"] = [client.alpha for client in clients]
        record["seconds"] = time.perf_counter() - started
        history.append(record)
        print(json.dumps({k: v for k, v in record.items() if k != "alphas"}), flush=True)

    initial = state_to_arrays(federated_state(model))
    strategy = strategy_for(method, settings, len(nodes))
    result = strategy.start(grid, initial, settings.rounds, round_end_fn=score_round)
    wall = time.perf_counter() - started
    aggregate = arrays_to_state(result.arrays)
    load_federated_state(model, aggregate)
    model.eval()
    final = score_server_field(model, data, config, None)
    cost = strategy.cost_model.round_cost(
        sum(t.numel() for t in aggregate.values()), len(data.users)
    )
    rays = sum(user.scene.images.shape[:3].numel() for user in data.users)
    rays_trained = rays * settings.epochs * settings.rounds
    return {
        "method": method,
        "history": history,
        "final": final,
        "wall-seconds": wall,
        "train-seconds": bench.train_seconds,
        "rays-per-second": rays_trained / max(bench.train_seconds, 1e-9),
        "rays-drawn": bench.rays,
        "rays-dropped": bench.dropped_rays,
        "server-flops-per-round": cost.server_flops,
        "bytes-per-round": cost.uplink_bytes + cost.downlink_bytes,
        "alphas": [list(trace) for trace in zip(*(r["alphas"] for r in history), strict=True)],
        "state": aggregate,
    }

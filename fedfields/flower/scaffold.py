"""Scaffold (Karimireddy et al. 2020, Algorithm 1) on the fedfields protocol: the server
strategy and the client's control variate (`ScaffoldClient`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from logging import INFO
from typing import Any, Unpack

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from torch import Tensor

from fedfields.flower.node import NodeState
from fedfields.flower.protocol import (
    ARRAYS,
    CLIENT_CONTROL,
    CONFIG,
    CONTROL_DELTA,
    SERVER_CONTROL,
    STRATEGY,
    BadReply,
    arrays_to_state,
    state_to_arrays,
)
from fedfields.flower.reply_gate import CheckedReply
from fedfields.flower.round import Round, RoundOutcome
from fedfields.flower.strategy import ProtocolStrategy
from fedfields.flower.strategy_options import StrategyOptions, optional_cap
from fedfields.methods import (
    SCAFFOLD_COST,
    scaffold_server_update_from_sums,
)
from fedfields.methods.robust import update_norm
from fedfields.methods.settings import NON_NEGATIVE, StrategySettings, setting
from fedfields.methods.states import check_scalar

DEFAULT_MAX_CONTROL_NORM = 1e6
"""Cap on ||delta c_i||: a control variate estimates a mean gradient (at most about
sqrt(d) for Adam-sized steps, under 1e4 for the fields here); 1e6 leaves room for any honest
client and none for one that would scale every later gradient."""


@dataclass(frozen=True)
class ScaffoldSettings(StrategySettings):
    """Scaffold's run-config keys."""

    global_lr: float = setting(
        1.0, "scaffold-global-lr", "Scaffold's server step size", NON_NEGATIVE
    )
    max_control_norm: float = setting(
        DEFAULT_MAX_CONTROL_NORM,
        "max-control-norm",
        "Scaffold: a reply with ||delta c_i|| above it is dropped (0: no cap)",
        NON_NEGATIVE,
    )


class Scaffold(ProtocolStrategy):
    """Scaffold: x <- x + lr_g mean(y_i - x), c <- c + |S|/N mean(delta c_i) (Algorithm 1).

    Train messages carry ARRAYS (x), SERVER_CONTROL (c, zeros at first, same keys as x) and
    CONFIG; replies carry ARRAYS (y_i), CONTROL_DELTA (delta c_i) and optional METRICS. A bad
    reply (`fedfields.flower.reply_gate`; ||y_i - x|| bounded by `max_update_norm`) is
    dropped whole and counted.
    N is the number of connected nodes when the round is sampled. Clients keep their own
    c_i in their node state (`ScaffoldClient`).

    A plaintext reply's ||delta c_i|| above `max_control_norm` is dropped ("control-norm"):
    honest controls estimate a mean gradient, while a 1e30 delta would become the server
    control c that every client adds to each of its gradients.

    Args:
        global_lr: server step size lr_g.
        max_control_norm: the cap on ||delta c_i|| (0 or None: no cap).
        **options: sampling, "local-steps" and `secure_aggregation` (`StrategyOptions`); under
            secure aggregation the server sums y_i - x and delta c_i and learns only the sums.

    Attributes:
        server_control: c as a state dict, carried across rounds (empty before round 1; set
            it to {} to restart with zeros).
        global_state: x as sent in the current round (aggregate_train receives no arrays).
    """

    strategy_name = "scaffold"
    delta_records = (ARRAYS,)
    cost_model = SCAFFOLD_COST
    settings_class = ScaffoldSettings

    def __init__(
        self,
        *,
        global_lr: float = 1.0,
        max_control_norm: float | None = DEFAULT_MAX_CONTROL_NORM,
        **options: Unpack[StrategyOptions],
    ) -> None:
        super().__init__(**options)
        self.global_lr = check_scalar(global_lr, "global_lr")
        self.max_control_norm = optional_cap(max_control_norm, "max_control_norm")
        self.server_control: dict[str, Tensor] = {}
        self.global_state: dict[str, Tensor] = {}

    def summary(self) -> None:
        """Log the server step size, then the shared summary."""
        log(INFO, "\t├──> Scaffold global_lr: %s", self.global_lr)
        super().summary()

    def resumable_state(self) -> dict[str, Any]:
        """The shared state plus the server control c."""
        return {**super().resumable_state(), "server-control": dict(self.server_control)}

    def restore_state(self, state: Mapping[str, Any]) -> None:
        """Take back the shared state and c."""
        super().restore_state(state)
        self.server_control = dict(state["server-control"])

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample nodes; send x and c, remembering x (aggregate_train receives no arrays)."""
        train_round = self.begin_round(server_round, arrays, grid)
        self.global_state = arrays_to_state(arrays)
        if not self.server_control:
            self.server_control = {key: torch.zeros_like(x) for key, x in self.global_state.items()}
        elif {key: tuple(c.shape) for key, c in self.server_control.items()} != train_round.shapes:
            raise ValueError(
                "server_control's keys or shapes differ from the global state's; "
                "set strategy.server_control = {} to restart from zeros"
            )
        content = RecordDict(
            {
                ARRAYS: arrays,
                SERVER_CONTROL: state_to_arrays(self.server_control),
                CONFIG: self.train_config(server_round, config),
            }
        )
        return self.messages(content, MessageType.TRAIN)

    def aggregate(self, train_round: Round, replies: Iterable[Message]) -> RoundOutcome:
        """x and c from the sums of y_i - x and delta c_i (Algorithm 1, lines 16-17) over the
        replies (the round's sum: a bad reply is dropped whole, neither its y_i nor its delta
        c_i is used); x and c stay as they were if nothing was summed."""
        shapes = train_round.shapes
        summed = train_round.sum(replies, {ARRAYS: shapes, CONTROL_DELTA: shapes})
        if summed is None:
            return train_round.outcome(None)
        new_global, self.server_control = scaffold_server_update_from_sums(
            self.global_state,
            summed.sums[ARRAYS],
            summed.sums[CONTROL_DELTA],
            len(summed.node_ids),
            self.server_control,
            num_clients_total=train_round.ledger.num_nodes_total,
            global_lr=self.global_lr,
        )
        return train_round.outcome(state_to_arrays(new_global))

    def check_update(self, train_round: Round, reply: CheckedReply) -> None:
        """The update-norm bound on y_i, then ||delta c_i|| at most `max_control_norm`."""
        super().check_update(train_round, reply)
        control = reply.states.get(CONTROL_DELTA)
        if control is None or self.max_control_norm is None:
            return
        if not update_norm(control) <= self.max_control_norm:
            raise BadReply(
                "control-norm",
                f"reply from node {reply.node_id}, record {CONTROL_DELTA!r}: ||delta c_i|| "
                f"exceeds max-control-norm = {self.max_control_norm:g}",
            )


@dataclass
class ScaffoldClient:
    """The client half of Scaffold: c from the train message, c_i from the node's private
    state (zeros at first); `correction` is c - c_i, `reply` keeps c_i+ and uploads delta c_i.
    """

    server_control: dict[str, Tensor]
    client_control: dict[str, Tensor]
    state: NodeState

    @classmethod
    def sent_by_scaffold(cls, msg: Message) -> bool:
        """Whether `msg` comes from a Scaffold server (its CONFIG names the strategy)."""
        return msg.content[CONFIG].get(STRATEGY) == Scaffold.strategy_name

    @classmethod
    def receive(cls, msg: Message, state: NodeState) -> ScaffoldClient:
        """c from `msg`'s SERVER_CONTROL record and this node's c_i."""
        if SERVER_CONTROL not in msg.content:
            raise ValueError(f"a Scaffold train message carries {SERVER_CONTROL!r}; this one not")
        server_control = arrays_to_state(msg.content[SERVER_CONTROL])
        client_control = state.tensors(CLIENT_CONTROL) or {
            key: torch.zeros_like(value) for key, value in server_control.items()
        }
        if client_control.keys() != server_control.keys():
            raise ValueError(
                "the node's Scaffold control c_i has other keys than the server's c: "
                "was its state directory used by another model?"
            )
        return cls(server_control, client_control, state)

    def correction(self) -> dict[str, Tensor]:
        """c - c_i, added to every local gradient (Algorithm 1, line 10)."""
        return {key: c - self.client_control[key] for key, c in self.server_control.items()}

    def reply(self, content: RecordDict, new_client_control: Mapping[str, Tensor]) -> None:
        """Keep c_i+ on the node and put delta c_i = c_i+ - c_i into the reply `content`."""
        delta = {key: value - self.client_control[key] for key, value in new_client_control.items()}
        self.state.put_tensors(CLIENT_CONTROL, new_client_control)
        content[CONTROL_DELTA] = state_to_arrays(delta)

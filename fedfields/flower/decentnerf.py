"""DecentNeRF's client half for a library user's ClientApp: the user's alpha_k as its node
keeps it, and the alpha-weighted train reply (Algorithm 1 of the DecentNeRF paper, lines
12-15, `fedfields.methods.decentnerf.DecentNeRF.client_reply`); the server half is the method
itself (`fedfields.flower.DecentNeRF`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import Message
from torch import Tensor

from fedfields.flower.client_hooks import reply_parts
from fedfields.flower.node import NodeState
from fedfields.flower.protocol import ReplyParts
from fedfields.methods.decentnerf import ALPHA_STATE, INITIAL_ALPHA


class DecentNeRFClient:
    """A DecentNeRF user's alpha_k in the node's private state, and its train reply: alpha_k
    updated from the message's G, then alpha_k g_k with alpha_k. The model and its loss stay
    the caller's; the gradient query is answered by `fedfields.flower.answer_gradient_query`.
    """

    def __init__(self, state: NodeState) -> None:
        self.state = state

    @property
    def alpha(self) -> float:
        """This user's current alpha_k (1 before its first round)."""
        return float(self._kept()["alpha"])

    @property
    def history(self) -> list[list[float]]:
        """[[round, alpha_k], ...] of the rounds this user trained in."""
        return list(self._kept()["history"])

    def keep_alpha(self, alpha: float) -> None:
        """Start this user at alpha_k = `alpha` instead of 1 (before its first round): a fixed
        weight when the server's alpha-lr is 0 (DecentNeRF(-L) with chosen weights)."""
        if self.history:
            raise ValueError("keep_alpha: this user has already trained; its alpha_k is its own")
        self.state.put_values(ALPHA_STATE, {**INITIAL_ALPHA, "alpha": float(alpha)})

    def train_reply(
        self, msg: Message, local_state: Mapping[str, Tensor], metrics: Mapping[str, float]
    ) -> Message:
        """The train reply: alpha_k g_k plus alpha_k (ARRAYS) and `metrics` (METRICS), alpha_k
        first updated from the message's G (`fedfields.methods.decentnerf.client_alpha`);
        `local_state` is kept as the next round's g_k^(m-1)."""
        return self.train_parts(msg, local_state, metrics).message(msg)

    def train_parts(
        self, msg: Message, local_state: Mapping[str, Tensor], metrics: Mapping[str, float]
    ) -> ReplyParts:
        """`train_reply` before it is sent (an app adds its own metrics in one place)."""
        return reply_parts(msg, self.state, local_state, metrics)

    def _kept(self) -> dict[str, Any]:
        """The stored alpha, history and round of the last upload, or the initial alpha_k = 1."""
        return self.state.values(ALPHA_STATE) or INITIAL_ALPHA

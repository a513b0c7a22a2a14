"""Which nodes a round asks: those connected, once enough are, sampled in user-key order.

`wait_for_nodes` is the one wait for nodes the server jobs share (a strategy's rounds, the
split job's one client): it polls the grid until enough nodes are connected or the timeout
has passed. `NodeSampler` draws a round's nodes as Flower's FedAvg does,
max(int(connected * fraction), least) but never more than are connected, with the strategy's
own seeded RNG over the nodes in user-key order (`fedfields.flower.user_keys`), so one seed
gives one run; the sample keeps that order, the order its messages are sent and its replies
summed.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from logging import INFO, WARNING

from flwr.common.logger import log
from flwr.serverapp import Grid

from fedfields.flower.user_keys import UserKeys, fallback_key

NODE_POLL_SECONDS = 0.5
"""How often a wait asks the grid for its nodes: a node that connects is seen within half a
second, and the SuperLink is asked twice a second at most."""


class InsufficientNodesError(RuntimeError):
    """Too few nodes stayed connected to run a round."""


def wait_for_nodes(grid: Grid, wanted: int, timeout: float | None) -> list[int]:
    """The connected nodes once `wanted` are, or those connected when `timeout` seconds have
    passed (None: wait for ever), fewer then; logs each poll that finds too few."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while len(nodes := list(grid.get_node_ids())) < wanted:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            break
        log(INFO, "waiting for nodes: %d connected, %d wanted", len(nodes), wanted)
        time.sleep(
            NODE_POLL_SECONDS if deadline is None else min(NODE_POLL_SECONDS, deadline - now)
        )
    return nodes


@dataclass
class NodeSampler:
    """A strategy's node sampling: its seeded `rng`, the nodes' `user_keys` (None: node-id
    order) and how long a round waits for nodes (`node_timeout`, None: for ever)."""

    rng: random.Random
    user_keys: UserKeys | None
    node_timeout: float | None

    def connected(self, grid: Grid, wanted: int, least: int) -> list[int]:
        """The connected nodes once `wanted` are, or after `node_timeout` with at least
        `least` (min-train-nodes, logged); InsufficientNodesError with fewer."""
        nodes = wait_for_nodes(grid, wanted, self.node_timeout)
        if len(nodes) < least:
            raise InsufficientNodesError(
                f"{len(nodes)} nodes connected after {self.node_timeout} s, fewer than "
                f"min-train-nodes = {least}: the federation has too few nodes"
            )
        if len(nodes) < wanted:
            log(
                WARNING, "%d of %d nodes connected; the round goes on with them", len(nodes), wanted
            )
        return nodes

    def round_nodes(
        self, grid: Grid, fraction: float, least: int, wanted: int
    ) -> tuple[list[int], int]:
        """A train round's sample and how many nodes were connected: once `wanted` are
        connected (or after `node_timeout`, with at least `least`), `fraction` of them, at
        least `least`; none for fraction 0."""
        if fraction == 0.0:
            return [], len(list(grid.get_node_ids()))
        connected = self.connected(grid, wanted, least)
        node_ids = self.sample(grid, connected, fraction, least)
        log(INFO, "configure_train: sampled %d of %d nodes", len(node_ids), len(connected))
        return node_ids, len(connected)

    def sample(
        self, grid: Grid, connected: Iterable[int], fraction: float, least: int
    ) -> list[int]:
        """max(int(len(connected) * fraction), least) of the `connected` nodes, at most all of
        them, drawn in user-key order and kept in it."""
        ordered = self.ordered(grid, connected)
        size = min(max(int(len(ordered) * fraction), least), len(ordered))
        return self.ordered(grid, self.rng.sample(ordered, size))

    def ordered(self, grid: Grid, node_ids: Iterable[int]) -> list[int]:
        """`node_ids` in user-key order (asking nodes not seen before which user they are),
        or by node id without `user_keys`."""
        if self.user_keys is None:
            return sorted(node_ids)
        node_ids = list(node_ids)
        self.user_keys.learn(grid, node_ids)
        return self.user_keys.ordered(node_ids)

    def users_of(self, node_ids: Iterable[int]) -> list[str]:
        """The user keys of `node_ids` ("node-<id>" without `user_keys`), in their order."""
        if self.user_keys is None:
            return [fallback_key(node_id) for node_id in node_ids]
        return self.user_keys.of(node_ids)

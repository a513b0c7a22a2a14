"""Which user each node is: the stable key a strategy samples and sums by, never a node id.

Flower 1.41 gives simulated SuperNodes random node ids (from os.urandom) and lists them as a
set, so a seeded sample over them picks other users in every run. Each node knows which user
it is (`user_key`): its partition-id in simulation; when deployed, its node-config `user`, else
its data folder's name, else its partition-id. The server asks each node once, with a
`query.user_key` message (`UserKeys.learn`; nodes that join later are asked when first seen),
orders the connected nodes by that key (digit runs compared as numbers) and samples them with
its seeded generator, and the replies are summed in that order
(`fedfields.flower.round_loop.StreamingGrid`). A node that does not answer, such as Flower's
stock quickstart ClientApp, keeps its node id as its key, with one warning: its place in the
order then depends on Flower's random ids.

A strategy asks only with `sample_by_user=True` (this App's strategies do): Flower's
ClientApp raises for a message type it has no handler for and logs an ERROR with a traceback,
so by default a library strategy asks nothing and orders nodes by id. A library user's
ClientApp answers the query with `answer_user_key`:

    app.query(USER_KEY_ACTION)(answer_user_key)
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from logging import WARNING
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from fedfields.flower.node import DATA_DIR, PARTITION_ID, is_simulated

USER_KEY_ACTION = "user_key"
"""The query's action (an identifier, as Flower requires): message type "query.user_key"."""
USER_KEY_MESSAGE_TYPE = f"{MessageType.QUERY}.{USER_KEY_ACTION}"
USER_RECORD = "user"
"""The reply's ConfigRecord, holding the key under `USER_KEY`."""
USER_KEY = "user-key"
USER = "user"
"""A deployed node's node-config key naming its user."""
FALLBACK_PREFIX = "node-"
"""Key of a node that did not say which user it is: "node-<node id>"."""


def user_key(context: Context) -> str:
    """This node's user: partition-id in simulation; when deployed, node-config `user`, else
    its `data-dir` folder's name, else partition-id. ValueError when it has none of them."""
    config = context.node_config
    if not is_simulated(context):
        if USER in config:
            return str(config[USER])
        if DATA_DIR in config:
            return Path(str(config[DATA_DIR])).name
    if PARTITION_ID in config:
        return str(config[PARTITION_ID])
    raise ValueError(
        f"node {context.node_id}: node-config names no user: give it '{USER}', "
        f"'{DATA_DIR}' or '{PARTITION_ID}'"
    )


def fallback_key(node_id: int) -> str:
    """The key of a node that did not say which user it is: "node-<node id>"."""
    return f"{FALLBACK_PREFIX}{node_id}"


def answer_user_key(msg: Message, context: Context) -> Message:
    """A ClientApp's reply to the server's "query.user_key": this node's `user_key`."""
    content = RecordDict({USER_RECORD: ConfigRecord({USER_KEY: user_key(context)})})
    return Message(content, reply_to=msg)


DIGITS = re.compile(r"([0-9]+)")
"""A run of ASCII digits (a Unicode digit such as '²' is text)."""
MAX_KEY_LENGTH = 128
"""Longest user key a server takes: a key is written into every round's metrics line."""


def natural_order(key: str) -> tuple[tuple[int, int, str], ...]:
    """Sort key of a user key: runs of ASCII digits compare as numbers (their length first,
    then the digits, so no run is ever converted), so "user_10" follows "user_9"."""
    return tuple(
        (0, len(part.lstrip("0")), part.lstrip("0")) if DIGITS.fullmatch(part) else (1, 0, part)
        for part in DIGITS.split(key)
        if part
    )


def valid_key(key: object) -> bool:
    """Whether a node's answer is a key the server takes: a non-empty printable string of at
    most `MAX_KEY_LENGTH` characters."""
    return isinstance(key, str) and 0 < len(key) <= MAX_KEY_LENGTH and key.isprintable()


def reply_key(reply: Message) -> str | None:
    """The user key a reply to the query carries; None for an error or a malformed reply (not
    a string, empty, unprintable or longer than `MAX_KEY_LENGTH`)."""
    if reply.has_error() or USER_RECORD not in reply.content.config_records:
        return None
    key = reply.content.config_records[USER_RECORD].get(USER_KEY)
    return key if valid_key(key) else None


class UserKeys:
    """The server's map from node id to user key, learnt once per node."""

    def __init__(self, timeout: float | None = None) -> None:
        self.timeout = timeout
        """Seconds to wait for the nodes' answers (None: until all answered)."""
        self.keys: dict[int, str] = {}

    def learn(self, grid: Grid, node_ids: Iterable[int]) -> None:
        """Ask the nodes among `node_ids` not asked before which user they are; a node that
        does not answer keeps "node-<id>" (one warning per call naming them)."""
        unknown = sorted(set(node_ids) - set(self.keys))
        if not unknown:
            return
        messages = [
            Message(RecordDict(), dst_node_id=node_id, message_type=USER_KEY_MESSAGE_TYPE)
            for node_id in unknown
        ]
        for reply in grid.send_and_receive(messages, timeout=self.timeout):
            key = reply_key(reply)
            if key is not None and reply.metadata.src_node_id in unknown:
                self.keys[reply.metadata.src_node_id] = key
        silent = [node_id for node_id in unknown if node_id not in self.keys]
        for node_id in silent:
            self.keys[node_id] = fallback_key(node_id)
        if silent:
            log(
                WARNING,
                "%d node(s) did not say which user they are (no '%s' handler in their "
                "ClientApp?): they are ordered by Flower's node ids, which change every run",
                len(silent),
                USER_KEY_MESSAGE_TYPE,
            )
        self._warn_shared(unknown)

    def _warn_shared(self, node_ids: list[int]) -> None:
        """Warn when new nodes share a user key with another node (their order is then by id)."""
        seen: dict[str, int] = {}
        for node_id, key in self.keys.items():
            if key in seen and (node_id in node_ids or seen[key] in node_ids):
                log(WARNING, "nodes %d and %d are both user %r", seen[key], node_id, key)
            seen.setdefault(key, node_id)

    def ordered(self, node_ids: Iterable[int]) -> list[int]:
        """`node_ids` by user key (ties by node id); every node must have been learnt."""
        return sorted(node_ids, key=lambda node_id: (natural_order(self.keys[node_id]), node_id))

    def of(self, node_ids: Iterable[int]) -> list[str]:
        """The user keys of `node_ids`, in their order ("node-<id>" for one never learnt)."""
        return [self.keys.get(node_id, fallback_key(node_id)) for node_id in node_ids]

"""In-process Flower Grid for the tests and the in-process benchmarks (the Novel Blender bench):
messages go straight to each node's handler, no Ray.

Every node is a `flwr.clientapp.ClientApp` (Flower's own dispatch on message type) or a plain
`(message, context) -> reply` function, called synchronously with a Context that persists
across messages, so `context.state` behaves as on a SuperNode. Content is deep-copied both
ways (the real runtime serialises; SecAgg+ mods mutate what they receive), and every
message and reply is recorded for inspection. Flower 1.41 refuses to build a Message
outside a run, so the grid sets the process-wide TaskIdentity (an internal API).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict, UserConfig
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

NodeHandler = Callable[[Message, Context], Message]
"""What runs on a node: a ClientApp instance or a function with the same call signature."""

RUN_ID = 1
SERVER_TASK_ID = 1


def set_task_identity(node_id: int = SUPERLINK_NODE_ID, task_id: int = SERVER_TASK_ID) -> None:
    """Set Flower's TaskIdentity (run, node, task) so that `Message(...)` can be constructed."""
    TaskIdentity.run_id = RUN_ID
    TaskIdentity.node_id = node_id
    TaskIdentity.task_id = task_id


class InProcessGrid(Grid):
    """A Grid whose nodes are handlers called in this process, one persistent Context each.

    Args:
        nodes: one handler per node; the same ClientApp may serve several nodes.
        run_config: the run config every node's Context holds.
        first_node_id: node ids are first_node_id, first_node_id + 1, ...
        raise_errors: re-raise a handler's exception instead of replying with a Flower
            Error, which is what the real runtime does.

    Attributes:
        contexts: node id -> Context; node_config holds "partition-id" (the node's index in
            `nodes`) and "num-partitions".
        sent: every message pushed, as the server sent it (message id set).
        received: every reply the server received.
        offline: ids of nodes that stay connected but never reply (dropouts).
    """

    def __init__(
        self,
        nodes: Sequence[NodeHandler],
        *,
        run_config: UserConfig | None = None,
        first_node_id: int = 101,
        raise_errors: bool = False,
    ) -> None:
        set_task_identity()
        self._run = Run.create_empty(RUN_ID)
        self.handlers = {first_node_id + i: handler for i, handler in enumerate(nodes)}
        self.contexts = {
            node_id: Context(
                run_id=RUN_ID,
                node_id=node_id,
                node_config={"partition-id": i, "num-partitions": len(nodes)},
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
            for i, node_id in enumerate(self.handlers)
        }
        self.raise_errors = raise_errors
        self.sent: list[Message] = []
        self.received: list[Message] = []
        self.offline: set[int] = set()
        self._replies: dict[str, Message] = {}

    def set_run(self, run: Run) -> None:
        """Replace the (empty) Run this grid reports."""
        self._run = run

    @property
    def run(self) -> Run:
        """The Run this grid operates in."""
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """A new instruction message (Flower deprecates this in favour of `Message(...)`)."""
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        """Ids of all nodes, offline ones included (they are connected but silent)."""
        return list(self.handlers)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Deliver each message to its node now; replies wait for `pull_messages`."""
        message_ids = []
        for message in messages:
            node_id = message.metadata.dst_node_id
            if node_id not in self.handlers:
                raise ValueError(f"message for unknown node {node_id}")
            message_id = uuid4().hex
            message.metadata.__dict__["_message_id"] = message_id
            self.sent.append(copy.deepcopy(message))
            message_ids.append(message_id)
            if node_id not in self.offline:
                self._replies[message_id] = self._dispatch(copy.deepcopy(message))
        return message_ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Replies to the given message ids (each handed out once)."""
        replies = [self._replies.pop(i) for i in message_ids if i in self._replies]
        self.received.extend(copy.deepcopy(reply) for reply in replies)
        return replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push and pull at once; `timeout` is moot since handlers run synchronously."""
        return self.pull_messages(self.push_messages(messages))

    def _dispatch(self, message: Message) -> Message:
        """Run the node's handler as the node's task; exceptions become Error replies."""
        node_id = message.metadata.dst_node_id
        set_task_identity(node_id=node_id, task_id=SERVER_TASK_ID + 1)
        try:
            reply = self.handlers[node_id](message, self.contexts[node_id])
            if not isinstance(reply, Message):
                raise TypeError(f"handler returned {type(reply).__name__}, not a Message")
        except Exception as error:
            if self.raise_errors:
                raise
            reason = f"{type(error)}:<'{error}'>"
            error_code = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
            reply = Message(Error(code=error_code, reason=reason), reply_to=message)
        finally:
            set_task_identity()
        if reply.metadata.reply_to_message_id != message.metadata.message_id:
            raise ValueError(f"node {node_id} replied to another message")
        reply.metadata.__dict__["_message_id"] = uuid4().hex
        return copy.deepcopy(reply)

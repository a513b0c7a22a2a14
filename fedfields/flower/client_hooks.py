"""A node's half of any method: the method its train message names, the client hooks it
declares, the reply it makes and where what they leave goes.

`received_method(msg)` looks the message's "strategy" up in
`fedfields.methods.base.Method.registered`; `received_hooks(msg, state)` builds that method's
`client_hooks` from the message's records and the node's kept state, which the ClientApp passes
to the one local loop (`fedfields.train.federated.local_train`,
`fedfields.train.meta.local_meta_update`), with a personal field when the method declares one
(`Method.personal_field`). `reply_parts` then makes the train reply: the method's
`client_reply` of the local state (the state itself, or a payload scaled by the client's own
weight), "num-examples" when the method counts examples, and what the hooks leave
(`keep_results`: each kept state into the node's private state, each record into the reply).
`gradient_parts` answers a gradient query (`Method.gradient_query`) with the loss gradient at
the received global. The node never asks which method sent the message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from flwr.app import Message, RecordDict
from torch import Tensor

from fedfields.flower.node import NodeState
from fedfields.flower.protocol import (
    ARRAYS,
    CONFIG,
    GRADIENT,
    NUM_EXAMPLES,
    STRATEGY,
    ReplyParts,
    arrays_to_state,
    state_to_arrays,
)
from fedfields.flower.upload_compression import compressed_gradient
from fedfields.methods.base import ClientHook, HookResult, Method

LossGradient = Callable[[dict[str, Tensor]], Mapping[str, Tensor]]
"""The user's loss gradient dL_k/dg at a global state g (keys of g)."""


def received_method(msg: Message) -> type[Method]:
    """The method `msg` names (its CONFIG "strategy"); `Method`, FedAvg's client half, for a
    strategy that is not a registered `Method`."""
    return Method.registered.get(str(msg.content[CONFIG].get(STRATEGY, "")), Method)


def received_records(msg: Message) -> dict[str, dict[str, Tensor]]:
    """The message's array records as states, by name (ARRAYS: the global as received)."""
    return {name: arrays_to_state(record) for name, record in msg.content.array_records.items()}


def received_hooks(msg: Message, state: NodeState) -> list[ClientHook]:
    """The client hooks of the method `msg` names, built from its array records and this
    node's kept state."""
    config = msg.content[CONFIG]
    return received_method(msg).client_hooks(config, received_records(msg), state.tensors)


def reply_parts(
    msg: Message,
    state: NodeState,
    local_state: Mapping[str, Tensor],
    metrics: Mapping[str, float],
    num_examples: int | None = None,
    hook_results: Iterable[HookResult] = (),
) -> ReplyParts:
    """The train reply to `msg` before it is sent: the method's `client_reply` of
    `local_state` (CPU float32) and the hooks' records, with `metrics` plus `num_examples`
    when the method counts examples; what they keep goes into the node's `state`."""
    method = received_method(msg)
    config = msg.content[CONFIG]
    reply = method.client_reply(config, received_records(msg), state, local_state)
    records = RecordDict()
    keep_results([reply, *hook_results], records, state)
    reported = dict(metrics)
    if num_examples is not None and method.counts_examples:
        reported[NUM_EXAMPLES] = num_examples
    return ReplyParts(records, reported)


def keep_results(results: Iterable[HookResult], records: RecordDict, state: NodeState) -> None:
    """Each result's kept state into the node's private state, its records into the reply."""
    for result in results:
        for name, values in result.kept_values.items():
            state.put_values(name, values)
        for name, kept in result.kept.items():
            state.put_tensors(name, kept)
        for name, record in result.records.items():
            records[name] = state_to_arrays(record)


def gradient_parts(msg: Message, loss_gradient: LossGradient) -> ReplyParts:
    """A gradient query's reply before it is sent: G_k = `loss_gradient(g)` at the received
    global g, under GRADIENT."""
    received = arrays_to_state(msg.content[ARRAYS])
    gradient = dict(loss_gradient(received))
    if gradient.keys() != received.keys():
        raise ValueError(
            f"loss_gradient returned keys {sorted(gradient)}, not the global's {sorted(received)}"
        )
    return ReplyParts({GRADIENT: state_to_arrays(gradient)})


def answer_gradient_query(msg: Message, loss_gradient: LossGradient, seed: int = 0) -> Message:
    """Reply to a gradient query with G_k (`gradient_parts`), compressed when the query asks
    for compression (`compressed_gradient`; `seed` seeds quantise's rounding)."""
    return compressed_gradient(msg, gradient_parts(msg, loss_gradient), seed).message(msg)

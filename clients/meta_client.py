"""The FedMeNF client: local meta-learning on one client's private tasks (faces, a clip, an object).

Thin glue over `fedfields.train.meta.local_meta_update` (FedMeNF Algorithm 1, LocalUpdate): the
train message's ARRAYS are the global meta-learner theta, the reply's ARRAYS the local meta-learner
w_E with "num-examples" = |D| (the server's weight, Eq. 2). A node reads only its own data
(`fedfields.flower.node`): faces and video are scikit-image's, dealt by the node's client index
(node-config partition-id); an object is the node's own folder (node-config data-dir, or in
simulation run-config data-dir/object_NN); it meta-learns on node-config `device` (`node_device`)
and uploads CPU float32. The client runs the hooks of the method its message names (a loss
term, a control variate kept in its private node state; `fedfields.flower.client_hooks`) and
adds what they leave to the reply (`fedfields.flower.meta_train_parts` does all of it). The app adds
the client's index (record CLIENT) so that a simulation's audit can pair an upload with the
client's data; no strategy reads it.
"""

from __future__ import annotations

import dataclasses

from clients.client_call import ClientCall, ClientHalf
from fedfields.config import meta_settings
from fedfields.config.schema import META_TASKS
from fedfields.flower import meta_train_parts
from fedfields.flower.node import node_data_dir
from fedfields.flower.protocol import ReplyParts
from fedfields.train.builders import client_meta_tasks, client_seed, meta_config, meta_model


def train(call: ClientCall) -> ReplyParts:
    """E outer steps of the run-config's meta-learner from theta; reply w_E and |D|."""
    config = call.config
    settings = meta_settings(config)
    client = call.client
    meta = meta_config(
        config,
        settings,
        outer_steps=settings.outer_steps,
        seed=client_seed(config.common.seed, client, call.federated_round()),
    )
    meta = dataclasses.replace(meta, device=call.device)
    object_dir = node_data_dir(call.context, "object") if config.common.task == "objects" else None
    tasks = client_meta_tasks(config, settings, client, object_dir)
    return meta_train_parts(call.msg, meta_model(config, settings), tasks, meta, call.state)


HALF = ClientHalf("meta", mode="federated", tasks=META_TASKS, train=train)

"""The FedMeNF client: local meta-learning on one client's private tasks (faces, a clip, an object).

Thin glue over `fedfields.train.meta.local_meta_update` (FedMeNF Algorithm 1, LocalUpdate): the
train message's ARRAYS are the global meta-learner theta, the reply's ARRAYS the local meta-learner
w_E with "num-examples" = |D| (the server's weight, Eq. 2). A node reads only its own data
(`fedfields.flower.node`): faces and video are scikit-image's, dealt by the node's client index
(node-config partition-id); an object is the node's own folder (node-config data-dir, or in
simulation run-config data-dir/object_NN); it meta-learns on node-config `device` (`node_device`)
and uploads CPU float32. FedProx's mu comes as "proximal-mu"; for Scaffold the client keeps c_i in
its private node state (`NodeState`), adds c - c_i to every outer gradient and takes the round's
mean outer gradient as c_i+ (Scaffold's option I, evaluated along the local steps, so it holds for
AdamW too), uploading delta c_i (`fedfields.flower.meta_train_reply` does all of it). The reply also
carries the client's index (record CLIENT) so that a simulation's audit can pair an upload with the
client's data; no strategy reads it.
"""

from __future__ import annotations

import dataclasses

from flwr.app import ConfigRecord, Context, Message

from fedfields.config import FederatedConfig, meta_settings
from fedfields.flower import NodeState, client_index, meta_train_reply
from fedfields.flower.node import node_data_dir, node_device
from fedfields.flower.protocol import CLIENT, CLIENT_INDEX, CONFIG, SERVER_ROUND
from fedfields.train.builders import client_meta_tasks, meta_config, meta_model


def train(msg: Message, context: Context) -> Message:
    """E outer steps of the run-config's meta-learner from theta; reply w_E and |D|."""
    config = FederatedConfig.from_run_config(context.run_config)
    settings = meta_settings(config)
    client = client_index(context)
    device = node_device(context)
    meta = meta_config(
        config,
        settings,
        outer_steps=settings.outer_steps,
        proximal_mu=0.0,
        seed=config.common.seed * 100_003 + int(msg.content[CONFIG][SERVER_ROUND]) * 1009 + client,
    )
    meta = dataclasses.replace(meta, device=device)
    object_dir = node_data_dir(context, "object") if config.common.task == "objects" else None
    tasks = client_meta_tasks(config, settings, client, object_dir)
    reply = meta_train_reply(msg, meta_model(config, settings), tasks, meta, NodeState(context))
    reply.content[CLIENT] = ConfigRecord({CLIENT_INDEX: client})
    return reply

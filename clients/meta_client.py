"""The FedMeNF client: local meta-learning on one client's private tasks (faces, a clip, an object).

Thin glue over `fedfields.train.meta.local_meta_update` (FedMeNF Algorithm 1, LocalUpdate):
the train message's ARRAYS are the global meta-learner theta, the reply's ARRAYS the local
meta-learner w_E with "num-examples" = |D| (the server's weight, Eq. 2). A node reads only its
own data (`clients.node`): faces and video are scikit-image's, dealt by the node's client
index (node-config partition-id); an object is the node's own folder (node-config data-dir, or
in simulation run-config data-dir/object_NN). FedProx's mu comes as "proximal-mu"; for
Scaffold the client keeps c_i in its private node state (`NodeState`), adds c - c_i to every
outer gradient and takes the round's mean outer gradient as c_i+ (Scaffold's option I,
evaluated along the local steps, so it holds for AdamW too), uploading delta c_i. The reply
also carries the client's index (record CLIENT) so that a simulation's audit can pair an upload
with the client's data; no strategy reads it.
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from clients.node import NodeState, client_index, node_data_dir
from fedfields.flower_io import (
    ARRAYS,
    CONFIG,
    CONTROL_DELTA,
    LOCAL_STEPS,
    METRICS,
    NUM_EXAMPLES,
    PROXIMAL_MU,
    SERVER_CONTROL,
    SERVER_ROUND,
    STRATEGY,
    TRAIN_LOSS,
    arrays_to_state,
    state_to_arrays,
)
from fedfields.train.federated import load_federated_state
from fedfields.train.meta import local_meta_update
from fedfields.train.run_config import (
    FederatedConfig,
    client_meta_tasks,
    meta_config,
    meta_model,
    meta_settings,
)

CLIENT = "client"
"""Reply ConfigRecord naming the client: CLIENT_INDEX, its index among the N clients."""
CLIENT_INDEX = "index"
GAMMA = "gamma"
"""Reply metric: FedMeNF's mean gamma over the round's outer steps (adaptive or fixed)."""
CLIENT_CONTROL = "meta-client-control"  # Scaffold's c_i in the node's private state


def train(msg: Message, context: Context) -> Message:
    """E outer steps of the run-config's meta-learner from theta; reply w_E and |D|."""
    config = FederatedConfig.from_run_config(context.run_config)
    settings = meta_settings(config)
    round_config = msg.content[CONFIG]
    client = client_index(context)
    strategy = str(round_config.get(STRATEGY, config.strategy_name))
    model = meta_model(config, settings)
    theta = arrays_to_state(msg.content[ARRAYS])
    load_federated_state(model, theta)
    meta = meta_config(
        config,
        settings,
        outer_steps=int(round_config.get(LOCAL_STEPS, settings.outer_steps)),
        proximal_mu=float(round_config.get(PROXIMAL_MU, 0.0)) if strategy == "fedprox" else 0.0,
        seed=config.seed * 100_003 + int(round_config[SERVER_ROUND]) * 1009 + client,
    )
    object_dir = node_data_dir(context, "object") if config.task == "objects" else None
    tasks = client_meta_tasks(config, settings, client, object_dir)
    state = NodeState(context)
    correction = client_control = None
    if strategy == "scaffold":
        server_control = arrays_to_state(msg.content[SERVER_CONTROL])
        client_control = state.tensors(CLIENT_CONTROL) or {
            key: value.clone().zero_() for key, value in server_control.items()
        }
        correction = {key: c - client_control[key] for key, c in server_control.items()}
    result = local_meta_update(
        model,
        tasks,
        meta,
        global_reference=theta if meta.proximal_mu > 0 else None,
        scaffold_correction=correction,
    )
    metrics = {
        NUM_EXAMPLES: result.num_examples,
        TRAIN_LOSS: sum(result.outer_losses) / len(result.outer_losses),
    }
    if result.gammas:
        metrics[GAMMA] = sum(result.gammas) / len(result.gammas)
    content = RecordDict(
        {
            ARRAYS: state_to_arrays(result.state),
            METRICS: MetricRecord(metrics),
            CLIENT: ConfigRecord({CLIENT_INDEX: client}),
        }
    )
    if client_control is not None:
        new_control = result.mean_outer_gradient
        state.put_tensors(CLIENT_CONTROL, new_control)
        content[CONTROL_DELTA] = state_to_arrays(
            {key: value - client_control[key] for key, value in new_control.items()}
        )
    return Message(content, reply_to=msg)

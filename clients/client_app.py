"""The ClientApp: the NeRF scene job, or FedMeNF's meta-learning when run-config `task` says so.

For `task` faces, video or objects the train handler is `clients.meta_client.train`. The scene
job: one user's views, a global field it shares and a personal field it keeps; handlers are
thin glue over `fedfields.train.federated`. What stays on the node lives in
`context.state` across rounds: DecentNeRF's personal field and appearance embeddings, the
user's alpha and last local global field, the occupancy grid, Scaffold's client control.
Replies carry only what the strategy needs: the global field (or alpha * g_k and alpha for
DecentNeRF), Scaffold's control delta, DecentNeRF's gradient G_k, and scalar metrics. With
run-config `secure-aggregation` on, `secure_aggregation_mod` holds all of it back for
Flower's SecAgg+ (`clients.secure_aggregation`).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients import meta_client, split_client
from clients.meta_client import client_index
from clients.secure_aggregation import secure_aggregation_mod
from fedfields.aggregate import alpha_update, alpha_weighted_payload
from fedfields.data import Scene, load_scene
from fedfields.fields import HashGridField
from fedfields.fields.personal import PersonalField, PersonalFieldConfig
from fedfields.flower_io import (
    ARRAYS,
    CONFIG,
    CONTROL_DELTA,
    GRADIENT,
    METRICS,
    SERVER_CONTROL,
    arrays_to_state,
    state_to_arrays,
)
from fedfields.render import OccupancyGrid
from fedfields.train.federated import (
    LocalTrainConfig,
    ScaffoldControls,
    federated_state,
    load_federated_state,
    local_train,
    loss_gradient,
)
from fedfields.train.run_config import FederatedConfig, global_field, render_config

PERSONAL = "personal-field"
OCCUPANCY = "occupancy"
PREVIOUS_GLOBAL = "previous-global"
CLIENT_CONTROL = "client-control"
USER = "user"  # ConfigRecord in context.state: alpha
OCCUPANCY_UPDATE_EVERY = 32  # a grid refresh costs ~5 local steps; the grid persists per node
GRADIENT_RAYS = 2048  # pixels behind G_k: enough for its direction, cheap next to training

app = ClientApp(mods=[secure_aggregation_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train locally from the received global field; reply with what the strategy aggregates."""
    config = FederatedConfig.from_run_config(context.run_config)
    if config.mode == "split":
        return split_client.train(msg, context)
    if config.task != "scene":
        return meta_client.train(msg, context)
    round_config = msg.content[CONFIG]
    scene = _user_scene(context, config)
    field = _global_field(config, scene, msg)
    occupancy = _occupancy(context, scene)
    strategy = _strategy(config, msg)
    personal = _personal_field(context, scene) if strategy == "decentnerf" else None
    reference = federated_state(field)
    user = client_index(context)
    scaffold = None
    if strategy == "scaffold":
        server_control = arrays_to_state(msg.content[SERVER_CONTROL])
        client_control = _state_tensors(context, CLIENT_CONTROL) or {
            key: torch.zeros_like(value) for key, value in server_control.items()
        }
        scaffold = ScaffoldControls(server=server_control, client=client_control)
    local = LocalTrainConfig(
        steps=int(round_config.get("local-steps", config.local_steps)),
        learning_rate=config.learning_rate,
        personal_learning_rate=config.personal_learning_rate,
        target_samples=config.target_samples,
        personal_density_weight=config.personal_density_weight,
        proximal_mu=float(round_config.get("proximal-mu", 0.0)),
        occupancy_update_every=OCCUPANCY_UPDATE_EVERY,
        seed=config.seed * 100_003 + int(round_config["server-round"]) * 1009 + user,
    )
    result = local_train(
        field,
        scene,
        local,
        render_config(scene),
        occupancy,
        personal_field=personal,
        global_reference=reference,
        scaffold=scaffold,
    )
    context.state[OCCUPANCY] = state_to_arrays(occupancy.state_dict())
    metrics = {"train-loss": result.loss, "train-psnr": result.psnr}
    local_state = federated_state(field)
    content = RecordDict()
    if strategy == "decentnerf":
        context.state[PERSONAL] = state_to_arrays(personal.state_dict())
        alpha = _updated_alpha(context, config, msg)
        context.state[PREVIOUS_GLOBAL] = state_to_arrays(local_state)
        content[ARRAYS] = state_to_arrays(alpha_weighted_payload(local_state, alpha))
        _log_alpha(round_config, user, alpha)
    else:
        content[ARRAYS] = state_to_arrays(local_state)
        metrics["num-examples"] = result.num_examples
    if scaffold is not None:
        context.state[CLIENT_CONTROL] = state_to_arrays(result.client_control)
        content[CONTROL_DELTA] = state_to_arrays(result.control_delta)
    content[METRICS] = MetricRecord(metrics)
    return Message(content, reply_to=msg)


@app.query("gradient")
def gradient(msg: Message, context: Context) -> Message:
    """DecentNeRF's G_k: the loss gradient at the received aggregate, both fields frozen."""
    config = FederatedConfig.from_run_config(context.run_config)
    scene = _user_scene(context, config)
    field = _global_field(config, scene, msg)
    personal = _personal_field(context, scene) if _strategy(config, msg) == "decentnerf" else None
    grads = loss_gradient(
        field,
        scene,
        render_config(scene),
        _occupancy(context, scene),
        personal_field=personal,
        num_rays=GRADIENT_RAYS,
        seed=config.seed + int(msg.content[CONFIG]["server-round"]),
    )
    return Message(RecordDict({GRADIENT: state_to_arrays(grads)}), reply_to=msg)


def _strategy(config: FederatedConfig, msg: Message) -> str:
    """The strategy named in the server's message (a plug-in server's wins), else run-config's."""
    return str(msg.content[CONFIG].get("strategy", config.strategy_name))


def _user_dir(context: Context, config: FederatedConfig) -> Path:
    """The user's dataset: node-config 'user-dir' on a deployed node, else data-dir/user_NN."""
    if "user-dir" in context.node_config:
        return Path(str(context.node_config["user-dir"]))
    if not config.data_dir:
        raise ValueError("run-config 'data-dir' is empty: pass the absolute path of a crowd")
    return Path(config.data_dir) / f"user_{client_index(context):02d}"


def _user_scene(context: Context, config: FederatedConfig) -> Scene:
    return _load_user_scene(str(_user_dir(context, config)), config.downscale)


@lru_cache(maxsize=64)
def _load_user_scene(path: str, downscale: float) -> Scene:
    """A user's views, read once per process (simulation actors serve many rounds)."""
    return load_scene(path, downscale=downscale)


def _global_field(config: FederatedConfig, scene: Scene, msg: Message) -> HashGridField:
    field = global_field(config, scene)
    load_federated_state(field, arrays_to_state(msg.content[ARRAYS]))
    return field


def _personal_field(context: Context, scene: Scene) -> PersonalField:
    """The personal field kept on this node (created on first use, never sent)."""
    aabb = tuple(scene.aabb.reshape(-1).tolist())
    personal = PersonalField(PersonalFieldConfig(num_images=len(scene), aabb=aabb))
    state = _state_tensors(context, PERSONAL)
    if state is not None:
        personal.load_state_dict(state)
    return personal


def _occupancy(context: Context, scene: Scene) -> OccupancyGrid:
    grid = OccupancyGrid(scene.aabb)
    state = _state_tensors(context, OCCUPANCY)
    if state is not None:
        grid.load_state_dict(state)
    return grid


def _state_tensors(context: Context, name: str) -> dict[str, torch.Tensor] | None:
    return arrays_to_state(context.state[name]) if name in context.state else None


def _updated_alpha(context: Context, config: FederatedConfig, msg: Message) -> float:
    """alpha_k after Algorithm 1 line 12, when G and this user's last local field exist."""
    record = context.state.get(USER, ConfigRecord({"alpha": 1.0}))
    alpha = float(record["alpha"])
    previous = _state_tensors(context, PREVIOUS_GLOBAL)
    if GRADIENT in msg.content and previous is not None:
        gradient_sum = arrays_to_state(msg.content[GRADIENT])
        alpha_lr = float(msg.content[CONFIG].get("alpha-lr", config.alpha_lr))
        alpha = alpha_update(alpha, gradient_sum, previous, alpha_lr)
    context.state[USER] = ConfigRecord({"alpha": alpha})
    return alpha


def _log_alpha(round_config: ConfigRecord, user: int, alpha: float) -> None:
    """In simulation the run directory is shared: append this user's alpha for the report."""
    run_dir = str(round_config.get("run-dir", ""))
    if run_dir and Path(run_dir).is_dir():
        line = {"round": int(round_config["server-round"]), "user": user, "alpha": alpha}
        with (Path(run_dir) / "alphas.jsonl").open("a") as log:
            log.write(json.dumps(line) + "\n")

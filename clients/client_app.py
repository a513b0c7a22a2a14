"""The ClientApp: the NeRF scene job, or FedMeNF's meta-learning when run-config `task` says so.

For `task` faces, photos, video or objects the train handler is `clients.meta_client.train`;
for mode split, `clients.split_client.train`. The scene job: one user's views (its own folder, from
node-config `data-dir`, `fedfields.flower.node`), a global field it shares and a personal field it
keeps; handlers are thin glue over `fedfields.train.federated`. Training, the gradient query and the
client's evaluation renders run on node-config `device` (`node_device`: auto picks CUDA when the
node sees one); replies carry CPU float32 whatever the device. What stays on the node lives in its
private state (`NodeState`: the node's state directory, or Flower's per-node context in a simulation
without one): DecentNeRF's personal field and appearance embeddings, the user's alpha and its
history, the last local global field, the occupancy grid, Scaffold's client control. Replies carry
only what the strategy needs: the global field (or alpha * g_k and alpha for DecentNeRF), Scaffold's
control delta, DecentNeRF's gradient G_k, and scalar metrics, among them "client-eval-psnr": the
received global field's PSNR on this user's held-out views (the last `client-eval-views`, never
trained on). With run-config `secure-aggregation` on, `secure_aggregation_mod` holds all of it back
for Flower's SecAgg+ (`fedfields.flower.secure_aggregation`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients import meta_client, split_client
from fedfields.config import FederatedConfig
from fedfields.data import Scene, load_scene
from fedfields.fields import HashGridField
from fedfields.fields.personal import PersonalField, PersonalFieldConfig
from fedfields.flower import (
    DecentNeRFClient,
    NodeState,
    ScaffoldClient,
    client_index,
    secure_aggregation_mod,
)
from fedfields.flower.node import node_data_dir, node_device
from fedfields.flower.protocol import (
    ARRAYS,
    CLIENT,
    CLIENT_INDEX,
    CLIENT_SECONDS,
    CONFIG,
    LOCAL_STEPS,
    METRICS,
    NUM_EXAMPLES,
    PROXIMAL_MU,
    SERVER_ROUND,
    TRAIN_LOSS,
    TRAIN_PSNR,
    TRAIN_STEPS,
    arrays_to_state,
    state_to_arrays,
)
from fedfields.render import OccupancyGrid
from fedfields.train.builders import check_scene_fits, global_field, render_config
from fedfields.train.federated import (
    LocalTrainConfig,
    ScaffoldControls,
    federated_state,
    heldout_psnr,
    load_federated_state,
    local_train,
)
from fedfields.train.federated import loss_gradient as loss_gradient_of

PERSONAL = "personal-field"
OCCUPANCY = "occupancy"
OCCUPANCY_UPDATE_EVERY = 32  # a grid refresh costs ~5 local steps; the grid persists per node
GRADIENT_RAYS = 2048  # pixels behind G_k: enough for its direction, cheap next to training
CLIENT_EVAL = "client-eval-psnr"
QUERY_TIMING = "query-timing"  # node-state values: {"round", "seconds"} of the last G_k query
EVAL_OCCUPANCY_PASSES = 2  # grid refreshes from the received field before scoring it


@dataclass(frozen=True)
class UserViews:
    """A user's views split into those it trains on and those it keeps for evaluation."""

    train: Scene
    heldout: Scene | None


app = ClientApp(mods=[secure_aggregation_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train locally; the reply's METRICS also carry the handler's wall seconds."""
    started = time.perf_counter()
    config = FederatedConfig.from_run_config(context.run_config)
    if config.common.mode == "split":
        return split_client.train(msg, context)
    handler = meta_client.train if config.common.task != "scene" else _train_scene
    reply = handler(msg, context)
    if METRICS in reply.content:
        seconds = time.perf_counter() - started
        query = NodeState(context).values(QUERY_TIMING)  # this round's gradient query, if any
        if query is not None and query["round"] == int(msg.content[CONFIG][SERVER_ROUND]):
            seconds += float(query["seconds"])
        reply.content[METRICS][CLIENT_SECONDS] = seconds
    return reply


def _train_scene(msg: Message, context: Context) -> Message:
    """Train locally from the received global field; reply with what the strategy aggregates."""
    config = FederatedConfig.from_run_config(context.run_config)
    round_config = msg.content[CONFIG]
    state = NodeState(context)
    device = node_device(context)
    views = _user_views(context, config)
    scene = views.train
    field = _global_field(config, msg)
    metrics: dict[str, float] = {}
    if views.heldout is not None:
        settings = render_config(config, views.heldout)
        metrics[CLIENT_EVAL] = heldout_psnr(
            field, views.heldout, settings, device, EVAL_OCCUPANCY_PASSES
        )
    occupancy = _occupancy(state, field)
    decentnerf = (
        DecentNeRFClient(state, config.scene.alpha_lr) if DecentNeRFClient.wanted(msg) else None
    )
    user = client_index(context)
    personal = _personal_field(state, config, scene, user) if decentnerf else None
    scaffold = ScaffoldClient.receive(msg, state) if ScaffoldClient.wanted(msg) else None
    server_round = int(round_config[SERVER_ROUND])
    local = LocalTrainConfig(
        steps=int(round_config.get(LOCAL_STEPS, config.scene.local_steps)),
        learning_rate=config.scene.learning_rate,
        personal_learning_rate=config.scene.personal_learning_rate,
        target_samples=config.scene.target_samples,
        personal_density_weight=config.scene.personal_density_weight,
        beta_min=config.scene.beta_min,
        proximal_mu=float(round_config.get(PROXIMAL_MU, 0.0)),
        occupancy_update_every=OCCUPANCY_UPDATE_EVERY,
        seed=config.common.seed * 100_003 + server_round * 1009 + user,
        device=device,
    )
    result = local_train(
        field,
        scene,
        local,
        render_config(config, scene),
        occupancy,
        personal_field=personal,
        global_reference=federated_state(field),
        scaffold=None
        if scaffold is None
        else ScaffoldControls(server=scaffold.server_control, client=scaffold.client_control),
    )
    state.put_tensors(OCCUPANCY, occupancy.state_dict())
    metrics |= {TRAIN_LOSS: result.loss, TRAIN_PSNR: result.psnr, TRAIN_STEPS: result.steps}
    local_state = federated_state(field)
    if decentnerf is not None and personal is not None:
        state.put_tensors(PERSONAL, personal.state_dict())
        reply = decentnerf.train_reply(msg, local_state, metrics)
    else:
        metrics[NUM_EXAMPLES] = result.num_examples
        content = RecordDict({ARRAYS: state_to_arrays(local_state)})
        if scaffold is not None:
            scaffold.reply(content, result.client_control)
        content[METRICS] = MetricRecord(metrics)
        reply = Message(content, reply_to=msg)
    reply.content[CLIENT] = ConfigRecord({CLIENT_INDEX: user})  # pairs uploads with users
    return reply


@app.query("gradient")
def gradient(msg: Message, context: Context) -> Message:
    """DecentNeRF's G_k; its wall seconds are kept for this round's train reply's
    "client-seconds" (the reply to the query carries nothing but G_k)."""
    started = time.perf_counter()
    reply = _gradient(msg, context)
    timing = {"round": int(msg.content[CONFIG][SERVER_ROUND])}
    NodeState(context).put_values(QUERY_TIMING, timing | {"seconds": time.perf_counter() - started})
    return reply


def _gradient(msg: Message, context: Context) -> Message:
    """DecentNeRF's G_k: the loss gradient at the received aggregate, both fields frozen."""
    config = FederatedConfig.from_run_config(context.run_config)
    state = NodeState(context)
    device = node_device(context)
    scene = _user_views(context, config).train
    personal = _personal_field(state, config, scene, client_index(context))
    seed = config.common.seed + int(msg.content[CONFIG][SERVER_ROUND])

    def loss_gradient(received: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        field = global_field(config)
        load_federated_state(field, received)
        return loss_gradient_of(
            field,
            scene,
            render_config(config, scene),
            _occupancy(state, field),
            personal_field=personal,
            num_rays=GRADIENT_RAYS,
            seed=seed,
            beta_min=config.scene.beta_min,
            device=device,
        )

    return DecentNeRFClient.answer_gradient_query(msg, loss_gradient)


def _user_views(context: Context, config: FederatedConfig) -> UserViews:
    """This node's user: its own folder's views, the last `client-eval-views` held out."""
    folder = node_data_dir(context, "user")
    views = _load_user_views(str(folder), config.common.downscale, config.scene.client_eval_views)
    check_scene_fits(config, views.train, f"node {context.node_id} ({folder})")
    return views


@lru_cache(maxsize=64)
def _load_user_views(path: str, downscale: float, heldout_views: int) -> UserViews:
    """A user's views, read once per process (simulation actors serve many rounds).

    Views are held out only while at least one is left to train on.
    """
    scene = load_scene(path, downscale=downscale)
    if heldout_views == 0 or heldout_views >= len(scene):
        return UserViews(scene, None)
    split = len(scene) - heldout_views
    return UserViews(scene.subset(list(range(split))), scene.subset(list(range(split, len(scene)))))


def _global_field(config: FederatedConfig, msg: Message) -> HashGridField:
    """The received global field, built from run-config's shapes (and `hash-backend`)."""
    field = global_field(config)
    load_federated_state(field, arrays_to_state(msg.content[ARRAYS]))
    return field


def _personal_field(
    state: NodeState, config: FederatedConfig, scene: Scene, user: int
) -> PersonalField:
    """The personal field kept on this node (created on first use from a per-user seed)."""
    box = render_config(config, scene).aabb
    with torch.random.fork_rng(devices=[]):  # built on the CPU: its RNG alone
        torch.manual_seed(config.common.seed * 100_003 + user)
        personal = PersonalField(PersonalFieldConfig(num_images=len(scene), aabb=box))
    saved = state.tensors(PERSONAL)
    if saved is not None:
        personal.load_state_dict(saved)
    return personal


def _occupancy(state: NodeState, field: HashGridField) -> OccupancyGrid:
    """The node's occupancy grid over the field's box (all set before the first update)."""
    grid = OccupancyGrid(field.aabb)
    saved = state.tensors(OCCUPANCY)
    if saved is not None:
        grid.load_state_dict(saved)
    return grid

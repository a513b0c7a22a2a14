"""The scene client (run-config task scene): one user of a crowd training a NeRF.

One user's views (its own folder, from node-config `data-dir`, `fedfields.flower.node`), a
global field it shares and a personal field it keeps; thin glue over
`fedfields.train.federated`. Training, the gradient query and the held-out score run on
node-config `device`; replies carry CPU float32 whatever the device. What stays on the node
lives in its private state (`NodeState`): the personal field and appearance embeddings of a
method that declares one, the occupancy grid, what the method's reply and client hooks keep
(`fedfields.flower.client_hooks`). A reply carries only what the method needs: the global
field (or the method's transform of it), the hooks' records, a gradient query's G_k, and
scalar metrics, among them
"client-eval-psnr": the received global field's PSNR on this user's held-out views (the last
`client-eval-views`, never trained on).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from clients.client_call import ClientCall, ClientHalf
from fedfields.config import FederatedConfig
from fedfields.data import Scene, load_scene
from fedfields.fields import Field, SplatAppearance, SplatField
from fedfields.fields.personal import PersonalField
from fedfields.flower import NodeState
from fedfields.flower.client_hooks import (
    gradient_parts,
    received_hooks,
    received_method,
    reply_parts,
)
from fedfields.flower.node import check_splat_limit, node_data_dir
from fedfields.flower.protocol import (
    ARRAYS,
    LOCAL_STEPS,
    TRAIN_LOSS,
    TRAIN_PSNR,
    TRAIN_STEPS,
    ReplyParts,
    arrays_to_state,
)
from fedfields.render import OccupancyGrid, RenderConfig
from fedfields.train.builders import (
    check_scene_fits,
    client_seed,
    global_field,
    gradient_chunk_rays,
    marches,
    personal_field_config,
    render_config,
    splat_field,
    splats,
)
from fedfields.train.federated import (
    LocalTrainConfig,
    StepGraphs,
    federated_state,
    heldout_psnr,
    load_federated_state,
    local_train,
)
from fedfields.train.federated import loss_gradient as loss_gradient_of
from fedfields.train.splats import local_train_splats, splat_loss_gradient

PERSONAL = "personal-field"
APPEARANCE = "personal-appearance"
OCCUPANCY = "occupancy"
OCCUPANCY_UPDATE_EVERY = 32  # a grid refresh costs several local steps; the grid persists per node
GRADIENT_RAYS = 2048  # pixels behind G_k: enough for its direction, cheap next to training
CLIENT_EVAL = "client-eval-psnr"
EVAL_OCCUPANCY_PASSES = 2  # grid refreshes from the received field before scoring it
STEP_GRAPHS = StepGraphs()
"""This process's static steps and CUDA graphs, shared by the virtual nodes a Ray actor runs
and kept for the whole run (a deployed node's ClientApp process lives for one message)."""


@dataclass(frozen=True)
class UserViews:
    """A user's views split into those it trains on and those it keeps for evaluation."""

    train: Scene
    heldout: Scene | None


def train(call: ClientCall) -> ReplyParts:
    """Train locally from the received global field; reply with what the strategy aggregates."""
    config, state, msg = call.config, call.state, call.msg
    _check_splats_fit(call)
    views = _user_views(call)
    scene = views.train
    field = _global_field(call)
    settings = render_config(config, scene)  # the held-out views share the scene's bounds
    metrics: dict[str, float] = {}
    if views.heldout is not None:
        passes = EVAL_OCCUPANCY_PASSES if marches(config) else 0
        metrics[CLIENT_EVAL] = heldout_psnr(field, views.heldout, settings, call.device, passes)
    occupancy = _occupancy(state, config)
    user = call.client
    personal = appearance = None
    if received_method(msg).personal_field:
        personal = _personal_field(state, config, settings, len(scene), user)
        appearance = _splat_appearance(state, config, len(scene))
    hooks = received_hooks(msg, state)
    local = LocalTrainConfig(
        steps=int(call.round_config.get(LOCAL_STEPS, config.scene.local_steps)),
        learning_rate=config.scene.learning_rate,
        personal_learning_rate=config.scene.personal_learning_rate,
        target_samples=config.scene.target_samples,
        personal_density_weight=config.scene.personal_density_weight,
        beta_min=config.scene.beta_min,
        occupancy_update_every=OCCUPANCY_UPDATE_EVERY,
        seed=client_seed(config.common.seed, user, call.federated_round()),
        device=call.device,
        step_mode="cuda-graph" if config.scene.cuda_graph else "dynamic",
    )
    if splats(config):
        weight = config.scene.splat_opacity_weight
        result = local_train_splats(
            field,
            scene,
            local,
            personal,
            hooks,
            weight,
            appearance,  # type: ignore[arg-type]
        )
    else:
        result = local_train(
            field, scene, local, settings, occupancy, personal_field=personal, hooks=hooks,
            graphs=STEP_GRAPHS,
        )  # fmt: skip
    if occupancy is not None:
        state.put_tensors(OCCUPANCY, occupancy.state_dict())
    metrics |= {TRAIN_LOSS: result.loss, TRAIN_PSNR: result.psnr, TRAIN_STEPS: result.steps}
    if personal is not None:
        state.put_tensors(PERSONAL, personal.state_dict())
    if appearance is not None:
        state.put_tensors(APPEARANCE, appearance.state_dict())
    local_state = federated_state(field)
    return reply_parts(msg, state, local_state, metrics, result.num_examples, result.hook_results)


def gradient(call: ClientCall) -> ReplyParts:
    """A gradient query's G_k: the loss gradient at the received aggregate, the global field
    and (when the method declares one) the personal field frozen."""
    config, state = call.config, call.state
    _check_splats_fit(call)
    scene = _user_views(call).train
    settings = render_config(config, scene)
    personal = appearance = None
    if received_method(call.msg).personal_field:
        personal = _personal_field(state, config, settings, len(scene), call.client)
        appearance = _splat_appearance(state, config, len(scene))
    seed = config.common.seed + call.federated_round()

    def loss_gradient(received: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        field = global_field(config)
        load_federated_state(field, received)
        if splats(config):
            return splat_loss_gradient(
                field,
                scene,
                personal,
                config.scene.personal_density_weight,
                call.device,
                config.scene.splat_opacity_weight,
                appearance,
            )  # type: ignore[arg-type]
        return loss_gradient_of(
            field,
            scene,
            settings,
            _occupancy(state, config),
            personal_field=personal,
            num_rays=GRADIENT_RAYS,
            seed=seed,
            beta_min=config.scene.beta_min,
            device=call.device,
            chunk_rays=gradient_chunk_rays(config),
        )

    return gradient_parts(call.msg, loss_gradient)


HALF = ClientHalf("scene", mode="federated", tasks=("scene",), train=train, gradient=gradient)


def _check_splats_fit(call: ClientCall) -> None:
    """A splat run's Gaussians (the shared set, and the personal ones its method keeps) within
    this node's node-config `max-splats`, before any is built."""
    config = call.config
    if splats(config):
        personal = (
            config.scene.personal_splat_count if received_method(call.msg).personal_field else 0
        )
        check_splat_limit(call.context, config.scene.splat_count, personal)


def _user_views(call: ClientCall) -> UserViews:
    """This node's user: its own folder's views, the last `client-eval-views` held out."""
    config = call.config
    folder = node_data_dir(call.context, "user")
    views = _load_user_views(str(folder), config.common.downscale, config.scene.client_eval_views)
    check_scene_fits(config, views.train, f"{call.node} ({folder})")
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


def _global_field(call: ClientCall) -> Field:
    """The received global field, built from run-config's shapes (and `hash-backend`)."""
    field = global_field(call.config)
    load_federated_state(field, arrays_to_state(call.msg.content[ARRAYS]))
    return field


def _personal_field(
    state: NodeState, config: FederatedConfig, settings: RenderConfig, num_images: int, user: int
) -> PersonalField | SplatField:
    """The personal field over `settings`' box for `num_images` views (the run-config's kind,
    `personal_field_config`; beside splats, `personal-splat-count` Gaussians), kept on this
    node (created on first use from a per-user seed)."""
    seed = client_seed(config.common.seed, user)
    personal: PersonalField | SplatField
    if splats(config):
        personal = splat_field(config, config.scene.personal_splat_count, seed)
    else:
        with torch.random.fork_rng(devices=[]):  # built on the CPU: its RNG alone
            torch.manual_seed(seed)
            personal = PersonalField(personal_field_config(config, settings, num_images))
    saved = state.tensors(PERSONAL)
    if saved is not None:
        personal.load_state_dict(saved)
    return personal


def _splat_appearance(
    state: NodeState, config: FederatedConfig, num_views: int
) -> SplatAppearance | None:
    """The user's per-view colour maps under run-config `splat-appearance` (identity at
    first), kept on this node; None for other fields or without the key."""
    if not (splats(config) and config.scene.splat_appearance):
        return None
    appearance = SplatAppearance(num_views)
    saved = state.tensors(APPEARANCE)
    if saved is not None:
        appearance.load_state_dict(saved)
    return appearance


def _occupancy(state: NodeState, config: FederatedConfig) -> OccupancyGrid | None:
    """The node's occupancy grid over the field's box (all set before the first update);
    None for the MLP field, which samples densely."""
    if not marches(config):
        return None
    grid = OccupancyGrid(render_config(config, None).aabb_tensor)
    saved = state.tensors(OCCUPANCY)
    if saved is not None:
        grid.load_state_dict(saved)
    return grid

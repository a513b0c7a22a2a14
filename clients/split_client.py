"""The split-learning client (run-config mode "split"): images, the loss and the field's head.

One "train" message per step (`simulations.split_job` drives them): the server's reply-to
carries the embeddings of the batch this client sent last; the client renders, returns the
embedding gradient (after its S2NeRF or NoisyLabel defence) and, pipelined in the same reply,
the rays of its next batch. The scene is the node's own (`scene_dir`); head, Adam state and the
pending batch are private state (`NodeState`: the node's state directory, or Flower's per-node
context). At "finish" the server sends its part so the client can assemble the joint field,
score it on its held-out views and keep checkpoint.pt, renders/ and client.json in its state
directory (which a simulation's attack observer reads as ground truth; the server never does).
The head renders, steps and scores on node-config `device` (`node_device`); the gradient and rays
it sends are CPU float32.
"""

from __future__ import annotations

import dataclasses
from logging import WARNING
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, Message
from flwr.common.logger import log
from torch import Tensor

from clients.client_call import ClientCall, ClientHalf
from fedfields import atomic
from fedfields.config import FederatedConfig
from fedfields.data import Scene
from fedfields.data.pixels import PixelSampler
from fedfields.fields import HashGridField
from fedfields.flower.node import DATA_DIR, NodeState, is_simulated, node_data_dir
from fedfields.flower.protocol import (
    EMBEDDINGS,
    GRADIENT,
    SAMPLES,
    SERVER_PART,
    SPLIT_STAGE,
    SPLIT_STEP,
    ReplyParts,
    arrays_to_state,
    state_to_arrays,
)
from fedfields.methods.base import to_wire
from fedfields.optim import make_optimizer
from fedfields.privacy import ClientDefence, NoisyLabel, RaySamples, S2NeRFNoise, split_field
from fedfields.privacy.split import (
    CLIENT_CHECKPOINT,
    CLIENT_RENDERS,
    CLIENT_REPORT,
    SPLIT_LEARNING_RATE,
    SPLIT_WEIGHT_DECAY,
    client_step,
    sample_rays,
)
from fedfields.render import RenderConfig
from fedfields.train.builders import (
    HOLDOUT_EVERY,
    SCENE_PREFIX,
    check_scene_fits,
    client_views,
    is_scene,
    joint_field,
    render_config,
)
from fedfields.train.checkpoint import save_checkpoint
from fedfields.train.evaluation import evaluate, write_renders

HEAD = "split-head"
HEAD_OPTIMIZER = "split-head-optimizer"
PENDING = "split-pending"  # the batch the server is embedding: rays, colours, background


def split_render_config(config: FederatedConfig, scene: Scene) -> RenderConfig:
    """Stratified sampling without an occupancy grid: the client cannot query density alone."""
    return dataclasses.replace(
        render_config(config, scene), num_samples=config.split.split_samples, num_importance=0
    )


def split_defence(config: FederatedConfig) -> ClientDefence | None:
    """The run-config's client defence: S2NeRF gradient noise or NoisyLabel (the parser
    refuses both)."""
    if config.split.split_noise_c > 0:
        return S2NeRFNoise(
            c=config.split.split_noise_c,
            r=config.split.split_noise_r,
            total_steps=config.split.split_steps,
            seed=config.common.seed,
        )
    if config.split.split_label_noise > 0:
        return NoisyLabel(config.split.split_label_noise, seed=config.common.seed)
    return None


def scene_dir(context: Context) -> Path:
    """This node's scene folder: node-config `data-dir` (a deployed SuperNode's own scene).

    A simulation's virtual node (`is_simulated`) takes run-config `data-dir`: either the
    scene itself, as the launcher gives its one virtual node, or a root of scene_NN folders
    (`fedfields.flower.node`).
    """
    root = Path(str(context.run_config.get(DATA_DIR, "")))
    if is_simulated(context) and root.parts and is_scene(root):
        return root
    return node_data_dir(context, SCENE_PREFIX)


def train(call: ClientCall) -> ReplyParts:
    """One split-learning exchange: "start", "step" or "finish" (CONFIG "split-stage").

    "start" begins afresh (a state directory may hold a previous run's head); the other
    stages continue from the head and Adam state kept in the node's state.
    """
    config, state, msg = call.config, call.state, call.msg
    stage = str(call.round_config[SPLIT_STAGE])
    if stage not in ("start", "step", "finish"):
        raise ValueError(f"{call.node}: unknown {SPLIT_STAGE!r}: {stage!r}")
    folder = scene_dir(call.context)
    scene, heldout = client_views(str(folder), config.common.downscale)
    check_scene_fits(config, scene, f"{call.node} ({folder})")
    field = joint_field(config).to(call.device)  # before Adam's state is loaded into it
    server, head = split_field(field)
    optimizer = make_optimizer(head, SPLIT_LEARNING_RATE, SPLIT_WEIGHT_DECAY)
    if stage != "start":
        head_state, optimizer_state = state.tensors(HEAD), state.tensors(HEAD_OPTIMIZER)
        if head_state is None or optimizer_state is None:
            raise RuntimeError(
                f"{call.node}: split stage {stage!r} without a started run "
                f"(no {HEAD!r} in its state {state.directory or 'context'})"
            )
        head.load_state_dict(head_state)
        _load_optimizer(optimizer, optimizer_state)
    if stage == "finish":
        return _finish(msg, state, config, field, server, scene, heldout)
    records: dict[str, ArrayRecord] = {}
    metrics: dict[str, float] | None = None
    step = int(call.round_config.get(SPLIT_STEP, -1))
    if stage == "step":
        records[GRADIENT], metrics = _learn(
            msg, state, config, head, optimizer, step, server.embedding_dim
        )
    if step + 1 < config.split.split_steps:
        records[SAMPLES] = _next_batch(state, config, scene, step + 1)
    state.put_tensors(HEAD, head.state_dict())
    state.put_tensors(HEAD_OPTIMIZER, _flat_optimizer_state(optimizer))
    return ReplyParts(records, metrics)


HALF = ClientHalf("split", mode="split", tasks=("scene",), train=train, round_reply=False)


def _learn(
    msg: Message,
    state: NodeState,
    config: FederatedConfig,
    head: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    embedding_dim: int,
) -> tuple[ArrayRecord, dict[str, float]]:
    """Render the pending batch from the server's embeddings; step the head; the gradient.

    The defence is built anew each step; its noise depends on (seed, step), so it differs
    from step to step (`fedfields.privacy.defences.step_noise`).
    """
    pending = state.tensors(PENDING)
    if pending is None:
        raise RuntimeError(f"split step {step}: no pending batch in the node's state")
    device = next(head.parameters()).device
    pending = {key: value.to(device) for key, value in pending.items()}
    samples = RaySamples(pending["origins"], pending["directions"], pending["edges"])
    embeddings = arrays_to_state(msg.content[EMBEDDINGS])["embeddings"].to(device)
    expected = (len(samples) * config.split.split_samples, embedding_dim)
    if tuple(embeddings.shape) != expected:
        raise ValueError(f"embeddings of shape {tuple(embeddings.shape)}, expected {expected}")
    for group in optimizer.param_groups:
        group["lr"] = SPLIT_LEARNING_RATE * 0.1 ** (step / config.split.split_steps)
    optimizer.zero_grad(set_to_none=True)
    result = client_step(
        head,
        embeddings,
        samples,
        pending["colors"],
        pending["background"],
        split_defence(config),
        step,
    )
    optimizer.step()
    gradient = state_to_arrays({"embeddings": to_wire(result.embedding_gradient)})
    return gradient, {"loss": result.loss, "psnr": result.psnr}


def _next_batch(state: NodeState, config: FederatedConfig, scene: Scene, step: int) -> ArrayRecord:
    """Draw batch `step` (seeded), keep it pending and return its rays for the server."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(config.common.seed * 1_000_003 + step)
    batch = PixelSampler(scene, random_background=True).sample(config.split.split_batch_rays)
    samples = sample_rays(batch.rays, split_render_config(config, scene), perturb=True)
    torch.random.set_rng_state(generator_state)
    rays = {"origins": samples.origins, "directions": samples.directions, "edges": samples.edges}
    state.put_tensors(PENDING, {**rays, "colors": batch.colors, "background": batch.background})
    return state_to_arrays(rays)


def _finish(
    msg: Message,
    state: NodeState,
    config: FederatedConfig,
    field: HashGridField,
    server: torch.nn.Module,
    scene: Scene,
    heldout: Scene,
) -> ReplyParts:
    """Assemble the joint field, score it on held-out views; keep checkpoint and renders in
    the node's state directory (a node without one only reports its scores)."""
    server.load_state_dict(arrays_to_state(msg.content[SERVER_PART]))
    settings = split_render_config(config, scene)
    result = evaluate(field, heldout, settings, progress=False)
    summary = {f"heldout-{key}": value for key, value in result.summary().items()}
    if state.directory is None:
        log(WARNING, "split client: no state directory, the joint field is not kept")
    else:
        write_renders(state.directory / CLIENT_RENDERS, heldout, result, settings)
        metadata = {"mode": "split", "heldout-every": HOLDOUT_EVERY}
        save_checkpoint(state.directory / CLIENT_CHECKPOINT, field, settings, None, metadata)
        atomic.write_json(state.directory / CLIENT_REPORT, summary)
    return ReplyParts({}, {key: value for key, value in summary.items() if value is not None})


def _flat_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    """Adam's per-parameter state as one flat tensor dict ("<index>.<name>")."""
    return {
        f"{index}.{name}": torch.as_tensor(value).reshape(-1) if name == "step" else value
        for index, values in optimizer.state_dict()["state"].items()
        for name, value in values.items()
    }


def _load_optimizer(optimizer: torch.optim.Optimizer, flat: dict[str, Tensor]) -> None:
    """Inverse of `_flat_optimizer_state` (the parameter groups are rebuilt, not stored)."""
    state: dict[int, dict[str, Tensor]] = {}
    for key, value in flat.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value.reshape(()) if name == "step" else value
    saved = optimizer.state_dict()
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})

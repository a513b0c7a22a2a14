"""A federated client's local computation: training a round, federated state, DecentNeRF's G_k.

Only the global field is federated. With a personal field the client trains DecentNeRF's
global+personal composite (NeRF-W's static and transient branches, DecentNeRF Sec. 4.2) and
the personal field stays on the device. A method's client hooks (`fedfields.methods.base.
ClientHook`: a loss term, a gradient correction) act on the global parameters only.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from fedfields.data.pixels import PixelSampler
from fedfields.data.scene import Scene
from fedfields.devices import resolve_device
from fedfields.fields import Field, GlobalPersonalField, PersonalField
from fedfields.methods.base import ClientHook, HookResult, check_state, to_wire
from fedfields.metrics import psnr
from fedfields.optim import make_optimizer
from fedfields.render import OccupancyGrid, RenderConfig, render_image, render_rays
from fedfields.train.centralised import adapt_batch_rays, checked_losses
from fedfields.train.nerfw import BETA_MIN, TRANSIENT_DENSITY_WEIGHT, PersonalLoss, local_loss
from fedfields.train.static_step import (
    STEP_MODES,
    CheckWindow,
    StaticBatch,
    StaticStep,
    StepMode,
    StepOutputs,
    graphs_supported,
    static_capacity,
    static_loss,
    static_optimizer,
    with_hook_terms,
)

LOSS_WINDOW = 10
FINITE_CHECK_EVERY = 16  # steps between reads of the losses (each read stalls a GPU's stream)
"""`LocalTrainResult.loss` averages the photometric loss of this many last steps."""


def federated_state(field: Field) -> dict[str, Tensor]:
    """The global field's parameters as detached CPU float32 copies: what a client sends and
    receives, whatever device and floating dtype it trains in (CPU and GPU nodes federate).

    Given a `GlobalPersonalField`, only its global field counts (keys without a prefix).
    """
    if isinstance(field, PersonalField):
        raise ValueError("a personal field is never federated; pass the global field")
    if isinstance(field, GlobalPersonalField):
        field = field.global_field
    return {name: to_wire(p) for name, p in field.named_parameters()}


def load_federated_state(field: Field, state: Mapping[str, Tensor]) -> None:
    """Copy `state` (keyed like `federated_state(field)`) into the global field's parameters."""
    if isinstance(field, GlobalPersonalField):
        field = field.global_field
    parameters = dict(field.named_parameters())
    check_state(state, parameters, "federated state")
    with torch.no_grad():
        for name, parameter in parameters.items():
            parameter.copy_(state[name])


@dataclass
class LocalTrainConfig:
    """One round of local training: steps, Adam settings, batch and loss weights.

    The learning rates stay constant within a round: a warm-up or decay inside each round
    would restart every round, so any schedule over rounds is the strategy's to send.
    """

    steps: int  # optimiser steps, or the cap on them when `epochs` is set
    epochs: float = 0.0  # > 0: end once this many passes over the scene's pixels were drawn
    learning_rate: float = 1e-2
    personal_learning_rate: float = 1e-2
    target_samples: int = 1 << 14  # adapt the ray batch to ~this many field samples per step
    batch_rays: int = 512  # the first step's batch
    max_batch_rays: int = 8192
    personal_density_weight: float = TRANSIENT_DENSITY_WEIGHT  # NeRF-W's lambda_u
    beta_min: float = BETA_MIN  # NeRF-W's floor on the personal uncertainty
    occupancy_update_every: int = 16
    random_background: bool = True
    weight_decay: float = 1e-6
    seed: int = 0
    device: str | torch.device = "auto"  # CUDA when visible; "cpu", "cuda", "cuda:N"
    step_mode: StepMode = "dynamic"  # "static" / "cuda-graph": fedfields.train.static_step

    def __post_init__(self) -> None:
        if self.step_mode not in STEP_MODES:
            raise ValueError(f"step_mode must be one of {STEP_MODES}, got {self.step_mode!r}")
        for name in ("steps", "batch_rays", "max_batch_rays", "occupancy_update_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.personal_density_weight >= 0:
            raise ValueError(
                f"personal_density_weight must be >= 0, got {self.personal_density_weight}"
            )
        if not (math.isfinite(self.epochs) and self.epochs >= 0):
            raise ValueError(f"epochs must be finite and >= 0, got {self.epochs}")
        if not self.beta_min > 0:
            raise ValueError(f"beta_min must be positive, got {self.beta_min}")


@dataclass
class LocalTrainResult:
    """What a round did, its closing photometric loss, and what its client hooks left."""

    steps: int
    rays: int
    samples: int
    seconds: float
    loss: float  # photometric MSE averaged over the last LOSS_WINDOW steps
    psnr: float  # of that loss
    num_examples: int  # pixels in the client's scene (FedAvg's weight)
    hook_results: list[HookResult] = field(default_factory=list)  # per hook, in order
    dropped_rays: int = 0  # static steps: rays left out of the loss (their samples overflowed)

    @property
    def rays_per_second(self) -> float:
        return self.rays / max(self.seconds, 1e-9)


def local_train(
    global_field: Field,
    scene: Scene,
    config: LocalTrainConfig,
    render_config: RenderConfig,
    occupancy: OccupancyGrid | None,
    personal_field: PersonalField | None = None,
    hooks: Sequence[ClientHook] = (),
    graphs: StepGraphs | None = None,
) -> LocalTrainResult:
    """Fit the global field (and the personal one, if given) to `scene` with Adam on the MSE.

    Loss: photometric MSE, or with a personal field NeRF-W's objective (`nerfw_loss`: colour
    error weighted by the personal uncertainty, log beta, `personal_density_weight` * mean
    personal density), plus each of `hooks`' loss term; each hook's
    `after_backward` corrects the global gradients before Adam's step (a control variate),
    and what the hooks leave is `LocalTrainResult.hook_results`, in their order.
    The occupancy grid follows the composite density, so personal content is sampled too.

    A static step (`config.step_mode`, `fedfields.train.static_step`) trains the same
    objectives in fixed shapes; 'cuda-graph' on a node without CUDA runs the static step
    uncaptured, with one warning, so one run-config serves CPU and GPU nodes. With `graphs`
    the static step trains in that cache's workspace (refilled in place), so its CUDA graphs
    serve every later call of the same kind too.
    """
    torch.manual_seed(config.seed)
    device = resolve_device(config.device)
    global_field.to(device).train()
    if personal_field is not None:
        personal_field.to(device).train()
    scene = scene.to(device)
    if occupancy is not None:
        occupancy.to(device)
    personal = None
    if personal_field is not None:
        personal = PersonalLoss(config.beta_min, config.personal_density_weight)
    cuda_graph = config.step_mode == "cuda-graph" and graphs_supported(device)
    if config.step_mode == "cuda-graph" and not cuda_graph:
        warnings.warn(
            f"step mode 'cuda-graph' needs CUDA; this node trains on {device}: static step, "
            "uncaptured",
            RuntimeWarning,
            stacklevel=2,
        )
    call = LocalCall(
        global_field, personal_field, personal, scene, config, render_config, occupancy,
        tuple(hooks), cuda_graph, device,
    )  # fmt: skip
    shared = graphs is not None and config.step_mode != "dynamic"
    workspace = graphs.workspace(call) if shared else LocalWorkspace(call)
    result = _train_steps(workspace, scene, config, render_config, occupancy)
    workspace.write_back(call)
    return result


@dataclass(frozen=True)
class LocalCall:
    """One `local_train` call's inputs, already on `device`: what a workspace is built from,
    or refilled with."""

    global_field: Field
    personal_field: PersonalField | None
    personal: PersonalLoss | None  # NeRF-W's loss weights, with a personal field
    scene: Scene
    config: LocalTrainConfig
    render_config: RenderConfig
    occupancy: OccupancyGrid | None
    hooks: tuple[ClientHook, ...]  # the method's, unbound
    cuda_graph: bool
    device: torch.device

    def owned(self) -> LocalCall:
        """This call with fields, scene and hooks of its own (a cache's workspace), so
        refilling them later never writes into the caller's objects."""
        personal = self.personal_field
        return replace(
            self,
            global_field=copy.deepcopy(self.global_field),
            personal_field=None if personal is None else copy.deepcopy(personal),
            scene=_cloned(self.scene),
            hooks=tuple(copy.deepcopy(hook) for hook in self.hooks),
        )

    def key(self) -> tuple:
        """Everything a captured step bakes in: two calls with equal keys replay the same
        graphs on refilled tensors (the learning rates are tensors, so they may differ)."""
        config, scene, occupancy = self.config, self.scene, self.occupancy
        random_background = config.random_background and bool((scene.masks < 1).any())
        personal_field = self.personal_field
        return (
            str(self.device),
            self.cuda_graph,
            _module_signature(self.global_field),
            None if personal_field is None else _module_signature(personal_field),
            self.personal,
            tuple(scene.images.shape),
            (scene.cameras.width, scene.cameras.height, random_background),
            self.render_config,
            None if occupancy is None else occupancy.resolution,
            static_capacity(config.target_samples, config.batch_rays, self.render_config),
            config.weight_decay,
            tuple(hook.key() for hook in self.hooks),
        )


class LocalWorkspace:
    """What a local step reads: the fields it trains, their optimiser, the scene's pixels,
    the method's bound client hooks, and the step (dynamic, or static with its
    graphs) that the one loop, `_train_steps`, calls.

    Built on one call's own objects, or, for static steps, owned by `StepGraphs` (built on
    `LocalCall.owned`) and refilled in place for every user and round (`refill`), so that
    graphs captured on its tensors replay for all of them.
    """

    def __init__(self, call: LocalCall) -> None:
        config, render_config, personal = call.config, call.render_config, call.personal
        global_field, personal_field = call.global_field, call.personal_field
        self.global_field, self.personal_field = global_field, personal_field
        self.field = _composite(global_field, personal_field, len(call.scene))
        self.parameters = dict(global_field.named_parameters())
        self.hooks = call.hooks
        for hook in self.hooks:
            hook.bind(self.parameters)
        static = config.step_mode != "dynamic"
        self.optimizer = _optimizer(global_field, config.learning_rate, config, call.device)
        self.global_groups = len(self.optimizer.param_groups)
        if personal_field is not None:
            rate = config.personal_learning_rate
            for group in _optimizer(personal_field, rate, config, call.device).param_groups:
                self.optimizer.add_param_group(group)
        self.sampler = PixelSampler(call.scene, config.random_background)
        self.capacity = static_capacity(config.target_samples, config.batch_rays, render_config)
        field, sampler, capacity, hooks = self.field, self.sampler, self.capacity, self.hooks

        def loss_fn(grid: OccupancyGrid | None, rays: int) -> StepOutputs:
            if not static:
                return dynamic_loss(field, sampler, render_config, grid, rays, hooks, personal)
            return static_loss(
                field, sampler, render_config, grid, rays, capacity, hooks, personal=personal
            )

        def after_backward() -> None:
            for hook in hooks:
                hook.after_backward()

        self.step = StaticStep(
            loss_fn, self.optimizer, call.occupancy, call.cuda_graph,
            after_backward if hooks else None, call.device,
        )  # fmt: skip

    def refill(self, call: LocalCall) -> None:
        """Copy one call's weights, scene and hooks into this workspace's tensors, and reset
        the optimiser to a fresh Adam's state: no tensor is rebound."""
        with torch.no_grad():
            self.global_field.load_state_dict(call.global_field.state_dict())
            if self.personal_field is not None and call.personal_field is not None:
                self.personal_field.load_state_dict(call.personal_field.state_dict())
            for hook, other in zip(self.hooks, call.hooks, strict=True):
                hook.refill(other)
            for state in self.optimizer.state.values():
                for value in state.values():
                    value.zero_()
            rates = [call.config.learning_rate, call.config.personal_learning_rate]
            for index, group in enumerate(self.optimizer.param_groups):
                group["lr"].fill_(rates[index >= self.global_groups])  # static: tensors
            self.sampler.refill(call.scene)
        self.step.bind(call.occupancy)

    def write_back(self, call: LocalCall) -> None:
        """Copy the trained weights into the call's fields, when they are not this
        workspace's own."""
        with torch.no_grad():
            if call.global_field is not self.global_field:
                call.global_field.load_state_dict(self.global_field.state_dict())
            personal_field = call.personal_field
            if personal_field is not None and personal_field is not self.personal_field:
                assert self.personal_field is not None
                personal_field.load_state_dict(self.personal_field.state_dict())


class StepGraphs:
    """A node process's static steps kept across users and rounds: one workspace per kind of
    call (`LocalCall.key`: the fields' shapes, the scene's size, the loss's options and
    hooks), so one
    CUDA graph per batch size serves the process's whole run instead of being recaptured
    for every user and round.

    A workspace holds a copy of the last user's weights and pixels on the device until the
    next call overwrites them; at most `max_workspaces` kinds are kept (least recently used
    dropped, with their graphs). Ray's simulation actors live for the run, so the graphs do;
    a deployed SuperNode starts a ClientApp process per message, so there they live for one
    round.
    """

    def __init__(self, max_workspaces: int = 2) -> None:
        self.max_workspaces = max_workspaces
        self.workspaces: OrderedDict[tuple, LocalWorkspace] = OrderedDict()
        self.dropped_captures = 0

    @property
    def captures(self) -> int:
        """Graphs captured so far, dropped workspaces' included."""
        live = sum(workspace.step.captures for workspace in self.workspaces.values())
        return self.dropped_captures + live

    def workspace(self, call: LocalCall) -> LocalWorkspace:
        """The workspace for this call, refilled with its weights, scene and hooks."""
        key = call.key()
        workspace = self.workspaces.get(key)
        if workspace is None:
            workspace = self.workspaces[key] = LocalWorkspace(call.owned())
            while len(self.workspaces) > self.max_workspaces:
                _, dropped = self.workspaces.popitem(last=False)
                self.dropped_captures += dropped.step.captures
        self.workspaces.move_to_end(key)
        workspace.refill(call)
        return workspace


def _module_signature(module: torch.nn.Module) -> tuple:
    """A module's class, configuration and state's names, shapes and dtypes."""
    state = tuple((name, tuple(t.shape), t.dtype) for name, t in module.state_dict().items())
    return type(module).__name__, repr(getattr(module, "config", None)), state


def _cloned(scene: Scene) -> Scene:
    """`scene` with tensors of its own, so refilling them leaves the caller's scene alone."""
    cameras = scene.cameras
    return replace(
        scene,
        images=scene.images.clone(),
        masks=scene.masks.clone(),
        cameras=replace(
            cameras,
            camera_to_world=cameras.camera_to_world.clone(),
            fx=cameras.fx.clone(),
            fy=cameras.fy.clone(),
            cx=cameras.cx.clone(),
            cy=cameras.cy.clone(),
        ),  # fmt: skip
        aabb=scene.aabb.clone(),
    )


def _optimizer(
    module: torch.nn.Module, learning_rate: float, config: LocalTrainConfig, device: torch.device
) -> torch.optim.Adam:
    """Adam for `module`: fused with tensor learning rates for a static step (its step reads
    nothing back, and a graph can capture it), the plain one for the dynamic step."""
    if config.step_mode == "dynamic":
        return make_optimizer(module, learning_rate, config.weight_decay)
    return static_optimizer(module, learning_rate, config.weight_decay, device)


def dynamic_loss(
    field: Field,
    sampler: PixelSampler,
    render_config: RenderConfig,
    occupancy: OccupancyGrid | None,
    batch_rays: int,
    hooks: Sequence[ClientHook],
    personal: PersonalLoss | None,
) -> StepOutputs:
    """Draw `batch_rays` pixels and render them with as many samples as marching finds (one
    host read); the MSE (with `personal`, NeRF-W's loss), plus the hooks' loss terms."""
    batch = sampler.sample(batch_rays)
    image_index = None if personal is None else batch.image_index
    rendered, num_samples = render_rays(
        field, batch.rays, render_config, occupancy, perturb=True, background=batch.background,
        image_index=image_index,
    )  # fmt: skip
    photometric, loss = local_loss(rendered, batch.colors, personal)
    return StepOutputs(with_hook_terms(loss, hooks), photometric, num_samples, 0)


class DynamicBatch:
    """The dynamic step's ray batch: after each step, resized so that a step holds about
    `target_samples` samples (nerfacc's rule, `adapt_batch_rays`), from the host count."""

    def __init__(self, config: LocalTrainConfig) -> None:
        self.rays, self.config = config.batch_rays, config

    def refreshed(self, grid: OccupancyGrid) -> int:
        return self.rays

    def stepped(self, outputs: StepOutputs) -> None:
        assert isinstance(outputs.samples, int)  # the dynamic step's host count
        self.rays = adapt_batch_rays(
            self.rays, outputs.samples, self.config.target_samples,
            self.config.max_batch_rays,
        )  # fmt: skip


def _train_steps(
    workspace: LocalWorkspace,
    scene: Scene,
    config: LocalTrainConfig,
    render_config: RenderConfig,
    occupancy: OccupancyGrid | None,
) -> LocalTrainResult:
    """The one local training loop, whatever the step mode: `config.steps` steps of the
    workspace's step (or `config.epochs` passes over the scene's pixels), the grid refreshed
    every `occupancy_update_every` steps; the losses and counts are read at the finite checks
    (every FINITE_CHECK_EVERY steps). A dynamic step resizes its batch after every step from
    its sample count (`stepped`); a static one at every grid refresh (`StaticBatch`)."""
    field, step = workspace.field, workspace.step
    batch: DynamicBatch | StaticBatch = DynamicBatch(config)
    if config.step_mode != "dynamic":
        batch = StaticBatch(
            workspace.sampler, render_config, workspace.capacity, config.batch_rays,
            config.max_batch_rays, config.target_samples, occupancy,
        )  # fmt: skip
    recent: deque[Tensor] = deque(maxlen=LOSS_WINDOW)  # photometric losses, on the device
    unchecked: list[Tensor] = []  # losses since the last finiteness check
    window = CheckWindow()  # sample and dropped-ray counts since the last check
    batch_rays, total_rays, total_samples, dropped_rays, steps = batch.rays, 0, 0, 0, 0
    epoch_rays = config.epochs * scene.images.shape[:3].numel()
    start = time.perf_counter()
    for index in range(config.steps):
        if epoch_rays and total_rays >= epoch_rays:
            break
        if occupancy is not None and index % config.occupancy_update_every == 0:
            occupancy.update(field.density, render_config.step_size)
            batch_rays = batch.refreshed(occupancy)
        outputs = step(batch_rays)
        recent.append(outputs.photometric.detach())
        unchecked.append(outputs.loss.detach())
        window.add(outputs, batch_rays)
        steps += 1
        total_rays += batch_rays
        batch.stepped(outputs)
        batch_rays = batch.rays
        if steps % FINITE_CHECK_EVERY == 0:
            checked_losses(unchecked, steps - len(unchecked), "local training")
            samples, dropped, _ = window.read()
            total_samples, dropped_rays = total_samples + samples, dropped_rays + dropped
            unchecked.clear()
    workspace.optimizer.zero_grad(set_to_none=True)  # no stale gradients outlive the round
    checked_losses(unchecked, steps - len(unchecked), "local training")
    samples, dropped, _ = window.read()
    total_samples, dropped_rays = total_samples + samples, dropped_rays + dropped
    losses = torch.stack(list(recent)).tolist()
    mean_loss = sum(losses) / len(losses)
    return LocalTrainResult(
        steps=steps,
        rays=total_rays,
        samples=total_samples,
        seconds=time.perf_counter() - start,
        loss=mean_loss,
        psnr=-10.0 * math.log10(max(mean_loss, 1e-10)),
        num_examples=scene.images.shape[:3].numel(),
        hook_results=[hook.finish(steps) for hook in workspace.hooks],
        dropped_rays=dropped_rays,
    )


def loss_gradient(
    global_field: Field,
    scene: Scene,
    render_config: RenderConfig,
    occupancy: OccupancyGrid | None,
    personal_field: PersonalField | None = None,
    num_rays: int = 4096,
    seed: int = 0,
    beta_min: float = BETA_MIN,
    device: str | torch.device | None = None,
    chunk_rays: int | None = None,
) -> dict[str, Tensor]:
    """DecentNeRF's G_k = dL_k/dg at the current weights, both fields frozen (Algorithm 1, l. 9).

    L_k is the local training loss (MSE, or NeRF-W's with a personal field; its sparsity term
    does not depend on g) on a fixed subset of `num_rays` pixels (at most all) from `seed`,
    rendered without jitter on the scene's own background, on `device` (default: where the
    global field is; both fields move there). No parameter or `.grad` changes; the result is
    keyed like `federated_state` (CPU float32).
    Memory grows with `num_rays`, all rendered in one pass unless `chunk_rays` splits them:
    then the loss's per-ray means are summed chunk by chunk, each weighted by its share of
    the rays (the same G up to float summation order, at one chunk's memory).
    """
    device = global_field.device if device is None else resolve_device(device)
    global_field.to(device)
    if personal_field is not None:
        personal_field.to(device)
    field = _composite(global_field, personal_field, len(scene))
    scene = scene.to(device)
    sampler = PixelSampler(scene, random_background=False)
    num_pixels = sampler.colors.shape[0]
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randperm(num_pixels, generator=generator)[:num_rays].to(device)
    personal = None if personal_field is None else PersonalLoss(beta_min)
    parameters = dict(global_field.named_parameters())
    chunk = len(pixels) if chunk_rays is None else max(1, chunk_rays)
    total: list[Tensor | None] = [None] * len(parameters)
    for start in range(0, len(pixels), chunk):
        batch = sampler.pixels(pixels[start : start + chunk])
        rendered, _ = render_rays(
            field,
            batch.rays,
            render_config,
            occupancy,
            background=batch.background,
            image_index=batch.image_index if personal_field is not None else None,
        )
        _, loss = local_loss(rendered, batch.colors, personal)
        if chunk < len(pixels):
            loss = loss * (len(batch.colors) / len(pixels))
        gradients = torch.autograd.grad(loss, list(parameters.values()), allow_unused=True)
        total = [
            g if t is None else (t if g is None else t + g)
            for t, g in zip(total, gradients, strict=True)
        ]
    return {
        name: to_wire(torch.zeros_like(p) if g is None else g)
        for (name, p), g in zip(parameters.items(), total, strict=True)
    }


@torch.no_grad()
def heldout_psnr(
    field: Field,
    views: Scene,
    render_config: RenderConfig,
    device: str | torch.device,
    occupancy_passes: int,
) -> float:
    """Mean PSNR of `field`'s renders of `views` on `device` (the field moves there), through
    a fresh occupancy grid of the field alone refreshed `occupancy_passes` times (0: no grid,
    `render_config`'s dense samples): a client's score of a received global field on its
    held-out views, as the server would render it."""
    field.to(resolve_device(device)).eval()
    occupancy = None
    if occupancy_passes > 0:
        occupancy = OccupancyGrid(render_config.aabb_tensor.to(field.device))
    for _ in range(occupancy_passes):
        occupancy.update(field.density, render_config.step_size)
    values = [
        psnr(render_image(field, views.cameras, i, render_config, occupancy).rgb.clamp(0, 1), image)
        for i, image in enumerate(views.images)
    ]
    field.train()
    return float(sum(values) / len(values))


def _composite(global_field: Field, personal_field: PersonalField | None, num_images: int) -> Field:
    """The field a client renders: the global one alone, or with its personal field."""
    if personal_field is None:
        return global_field
    if personal_field.config.num_images != num_images:
        raise ValueError(
            f"personal field has {personal_field.config.num_images} appearance embeddings "
            f"but the scene has {num_images} images"
        )
    return GlobalPersonalField(global_field, personal_field)

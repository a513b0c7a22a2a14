"""SDAR on SplitNeRF: a simulator of the client's head, trained on a scene the server owns.

What SDAR (paper 001, Sec. IV; `fedfields.privacy.attacks.sdar`) means for SplitNeRF
(paper 000, Sec. 3; `fedfields.privacy.split`). SplitNeRF cuts the field so that the
server holds the BOTTOM, g = hash grid + first density layer, and the client the TOP,
h = the remaining density layer and the colour head, with the images and the loss. The
client's "input" X is the batch of sample points, sent in the clear (poses are public in
paper 000's threat model), so the client's bottom model is the identity: this is U-shaped
split learning (Sec. IV-B) with f = id, or vanilla split learning with the labels, the
pixel colours, on the client. What is private is the client's head h and what it renders.
SDAR's parts therefore map as follows.

- Simulator f~, decoder f~^-1 and d2 (Eqs. 4-5): nothing to do. f~ of the identity is the
  identity and the "private inputs" are points the server already holds.
- Simulator h~ of the client's top (Sec. IV-B): a head of the client's architecture
  (`make_surrogate_head`), trained through the server's frozen g on the server's auxiliary
  data D': the pixels of a scene the server owns, here a procedural object ray-cast from
  cameras on the sphere of the client's ray origins (`procedural_scene`), never the
  client's scene. The task loss is the client's own, the volume-rendered MSE of Eq. 1 of
  paper 000 (`render_embeddings`), in place of the cross-entropy of paper 001:
      L_task = MSE(render(h~(g(points')), samples'), C~')
  where C~' are the auxiliary colours, each replaced with probability p by a uniformly drawn
  colour in [0, 1]^3: Sec. IV-B's random label flipping, for colours.
- The decoded output, Sec. IV-B's inferred labels Y^ = h~(g(Z_s)): the client's renders,
  server part + h~ at the client's rays (`render_split_view`, `score_attack`), compared as
  depth and grey views with the client's true renders, as the Surrogate Model Attack is.
- Adversarial regularisation (our transfer of d1, Eqs. 2-3): in U-shaped SDAR d1 acts on
  f~'s representations, which are gone here. The one thing the client's top sends the
  server is the cut-layer gradient g_i = dL/dE_i, so d1 tells the gradient rows the real
  client returned (the transcript) from those h~ would return for the auxiliary batch,
      d1:  L = BCE(d1(G'), 0) + BCE(d1(G), 1)                      (cf. Eq. 2)
      h~:  L = L_task + lambda_1 * BCE(d1(G'), 1),  G' = dL_task/dE' (create_graph)  (Eq. 3)
  each row divided by its batch's largest row norm (scene- and loss-scale free; the scale
  S2NeRF's sigma_t uses). What d1 picks up (measured: docs/experiments/2026-11-22-sdar-
  splitnerf.md, "Design measurements"): not W's row space (h~'s density-layer rows overlap
  the client's no more than random rows do), but the profile of the rows: the client's
  trained density is sharp, so each ray's gradient sits on a few samples; naive h~ answers
  diffusely on the auxiliary batch, SDAR's h~ like the client: it renders sharp surfaces
  where g says there is matter.

Why it works at all: g was trained jointly with h on the client's scene, so its embeddings
carry the client's geometry (paper 001, Sec. IV-D: the server's own part memorises private
information). h~ hardly fits the auxiliary scene through a g shaped by another one, yet
learning "embedding -> matter" through g reads the client's occupancy back out of it.

Runs offline on a recorded transcript, replayed in order with one attack step per protocol
step by default (the paper's cadence, Figs. 14-15): d1's real batch at attack step k is the
latest recorded exchange at or before k. Deviations (their figures, measured on lego 25x25
in the tests' setting and with simulations/bench/sdar_splitnerf.py, are in
docs/experiments/2026-11-22-sdar-splitnerf.md, "Design measurements", and on
docs/BENCHMARKS.md, "Split learning" and "Defaults, as measured"):

- the server part is its final state throughout (a `SplitExchange` carries no snapshot);
- lambda_1 = 0.4 and p = 0.2 (the digits task's U-shaped choice, `U_SHAPED_SDAR`), not
  Table VII's lambda_1 = 0.02: with d1 learning at lambda_1 * eta, 0.02 leaves it untrained
  in 200 steps, no better than colour flipping alone (the literal U-shaped reduction);
- under S2NeRF noise the real rows are mostly noise: d1 learns to spot it and drags h~
  away from the client, below the naive attack, which never reads the gradients: the noise
  reaches what g memorises only through g's own training.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedfields.data.figures import OBJECT_KINDS, OBJECT_RADIUS, random_object
from fedfields.data.pixels import PixelBatch, PixelSampler
from fedfields.data.scene import Scene
from fedfields.data.surfaces import IDENTITY, render_surfaces
from fedfields.geometry.cameras import CAMERA_ANGLE_X, Cameras, look_at
from fedfields.privacy.attacks.surrogate import SurrogateAttackConfig, make_surrogate_head
from fedfields.privacy.split import (
    ClientPart,
    RaySamples,
    ServerPart,
    SplitExchange,
    render_embeddings,
    sample_rays,
)
from fedfields.render.renderer import RenderConfig


@dataclass(frozen=True)
class SDARNeRFConfig:
    """SDAR on SplitNeRF: lambda_1, colour flipping, learning rates, cadence, model shapes."""

    lambda1: float = 0.4  # h~'s adversarial weight (Eq. 3); d1 learns at lambda1 * eta
    flip_probability: float = 0.2  # p of Sec. IV-B's random flip, on auxiliary colours
    learning_rate: float = 1e-2  # eta of h~ (Adam): the split training's own rate
    steps_per_exchange: int | None = None  # None: one per protocol step the exchange stands for
    discriminator_hidden: int = 64
    discriminator_dropout: float = 0.4  # before d1's logit, as paper 001's discriminators
    geometry_features: int = 15  # h~'s shape: the client's architecture (HashGridFieldConfig)
    color_hidden: int = 64
    color_layers: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.lambda1 < math.inf:
            raise ValueError(f"lambda1 must be finite and >= 0, got {self.lambda1}")
        if not 0 <= self.flip_probability <= 1:
            raise ValueError(f"flip_probability must be in [0, 1], got {self.flip_probability}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.steps_per_exchange is not None and self.steps_per_exchange < 1:
            raise ValueError(f"steps_per_exchange must be >= 1, got {self.steps_per_exchange}")
        if not 0 <= self.discriminator_dropout < 1:
            raise ValueError(
                f"discriminator_dropout must be in [0, 1), got {self.discriminator_dropout}"
            )
        for name in ("discriminator_hidden", "geometry_features", "color_hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def naive(cls, **overrides: float | int | None) -> SDARNeRFConfig:
        """The naive simulator attack: h~ on the auxiliary scene alone, no d1, no flipping."""
        return cls(lambda1=0.0, flip_probability=0.0, **overrides)  # type: ignore[arg-type]

    @property
    def discriminator_learning_rate(self) -> float:
        """lambda_1 * eta (paper 001, App. B-C)."""
        return self.lambda1 * self.learning_rate

    def head_config(self) -> SurrogateAttackConfig:
        """The shape fields `make_surrogate_head` reads."""
        return SurrogateAttackConfig(
            geometry_features=self.geometry_features,
            color_hidden=self.color_hidden,
            color_layers=self.color_layers,
        )


@dataclass
class SDARNeRFResult:
    """The simulated head h~, its per-step losses and the attack's wall time."""

    head: ClientPart
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)


def procedural_scene(
    render_config: RenderConfig,
    camera_distance: float,
    kind: str = "car",
    views: int = 40,
    resolution: int = 25,
    size: float = 1.2,
    seed: int = 0,
) -> Scene:
    """The server's auxiliary scene: a procedural object in the client's box, on white.

    A `random_object` of `kind` (bounding-sphere radius `size`, centred at the origin, z up)
    ray-cast (not volume-rendered) from `views` cameras at `camera_distance`, uniform in
    area over the upper hemisphere, with the NeRF-synthetic field of view. Everything the
    server needs is public: the box and the near/far bounds of `render_config`, the distance
    of the client's ray origins.
    """
    if kind not in OBJECT_KINDS:
        raise ValueError(f"kind must be one of {OBJECT_KINDS}, got {kind!r}")
    if views < 1 or resolution < 1:
        raise ValueError(f"need views >= 1 and resolution >= 1, got {views}, {resolution}")
    rng = np.random.default_rng([seed, 8])
    figure = random_object(rng, kind)
    figure = figure.transformed(IDENTITY, (0.0, 0.0, 0.0), size / OBJECT_RADIUS)
    yaw = rng.uniform(0.0, 2.0 * math.pi, size=views)
    elevation = np.arcsin(rng.uniform(0.0, 1.0, size=views))
    positions = camera_distance * np.stack(
        [np.cos(elevation) * np.cos(yaw), np.cos(elevation) * np.sin(yaw), np.sin(elevation)], -1
    )
    target = torch.zeros(3)
    poses = torch.stack([look_at(torch.tensor(p, dtype=torch.float32), target) for p in positions])
    focal = torch.full((views,), 0.5 * resolution / math.tan(0.5 * CAMERA_ANGLE_X))
    centre = torch.full((views,), resolution / 2)
    cameras = Cameras(poses, focal, focal.clone(), centre, centre.clone(), resolution, resolution)
    white = (1.0, 1.0, 1.0)
    rgba = render_surfaces([figure], cameras, background=white).rgba.clamp(0.0, 1.0)
    return Scene(
        images=rgba[..., :3].contiguous(),
        masks=rgba[..., 3].contiguous(),
        cameras=cameras,
        image_paths=(),
        background=white,
        aabb=render_config.aabb_tensor.reshape(2, 3).clone(),
        near=render_config.near,
        far=render_config.far,
    )


def gradient_discriminator(embedding_dim: int, hidden: int = 64, dropout: float = 0.4) -> nn.Module:
    """d1 on cut-layer gradient rows [N, d] -> logits [N, 1]: LeakyReLU MLP, dropout."""
    return nn.Sequential(
        nn.Linear(embedding_dim, hidden),
        nn.LeakyReLU(0.2),
        nn.Linear(hidden, hidden),
        nn.LeakyReLU(0.2),
        nn.Dropout(dropout),
        nn.Linear(hidden, 1),
    )


def scaled_rows(gradient: Tensor) -> Tensor:
    """Gradient rows [N, d] divided by their batch's largest row norm (d1's input)."""
    return gradient / gradient.norm(dim=-1).max().clamp_min(torch.finfo(gradient.dtype).tiny)


def flip_colours(colours: Tensor, probability: float, generator: torch.Generator) -> Tensor:
    """Each row of `colours` [R, 3] replaced by a uniform colour with `probability`."""
    flip = torch.rand(len(colours), generator=generator) < probability
    random = torch.rand(colours.shape, generator=generator)
    return torch.where(flip[:, None].to(colours.device), random.to(colours), colours)


def exchange_schedule(
    transcript: Sequence[SplitExchange], steps_per_exchange: int | None
) -> list[int]:
    """Attack steps per exchange: fixed, or the protocol steps to the next recorded one.

    The last exchange gets the median gap (the recording interval).
    """
    if steps_per_exchange is not None:
        return [steps_per_exchange] * len(transcript)
    gaps = [later.step - earlier.step for earlier, later in itertools.pairwise(transcript)]
    if any(gap < 1 for gap in gaps):
        raise ValueError("the transcript's exchanges must be in increasing step order")
    return gaps + [int(np.median(gaps)) if gaps else 1]


def sdar_nerf_attack(
    server: ServerPart,
    transcript: Sequence[SplitExchange],
    aux_scene: Scene,
    render_config: RenderConfig,
    config: SDARNeRFConfig | None = None,
) -> SDARNeRFResult:
    """Train the simulated head h~ on `aux_scene` through the frozen `server` part.

    Uses only what the server holds: its part (read, never updated), the transcript it
    recorded (d1's real gradient rows, and each exchange's ray count as the batch size) and
    its own auxiliary scene. Runs on the server part's device; the global RNG is left as it
    was. Decode with `render_split_view(server, result.head, ...)` at the client's rays.
    """
    config = config or SDARNeRFConfig()
    if not transcript:
        raise ValueError("the transcript is empty: train with record_every > 0")
    schedule = exchange_schedule(transcript, config.steps_per_exchange)
    device = next(server.parameters()).device
    generator = torch.Generator().manual_seed(config.seed)
    sampler = PixelSampler(aux_scene.to(device), random_background=False)
    history: list[dict[str, float]] = []
    start = time.perf_counter()
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # stratified jitter and dropout draw globally
        torch.manual_seed(config.seed)
        head = make_surrogate_head(server.embedding_dim, config.head_config()).to(device)
        head_optimizer = torch.optim.Adam(head.parameters(), lr=config.learning_rate)
        d1 = None
        if config.lambda1 > 0:
            d1 = gradient_discriminator(
                server.embedding_dim, config.discriminator_hidden, config.discriminator_dropout
            ).to(device)
            d1_optimizer = torch.optim.Adam(d1.parameters(), lr=config.discriminator_learning_rate)
        for exchange, steps in zip(transcript, schedule, strict=True):
            real = scaled_rows(exchange.gradient.to(device))
            for _ in range(steps):
                batch, samples, targets = _auxiliary_batch(
                    sampler, len(exchange.samples), render_config, config, generator
                )
                with torch.no_grad():
                    embeddings = server(samples.points())
                embeddings.requires_grad_(True)
                rendered = render_embeddings(head, embeddings, samples, batch.background)
                task = F.mse_loss(rendered.rgb, targets)
                losses = {"step": float(len(history)), "task": task.item()}
                loss = task
                if d1 is not None:  # Eq. 3 with G' = dL_task/dE', kept differentiable
                    (simulated,) = torch.autograd.grad(task, embeddings, create_graph=True)
                    fake = scaled_rows(simulated)
                    fooling = _bce(d1(fake), 1.0)
                    loss = loss + config.lambda1 * fooling
                    losses["simulator_adversarial"] = fooling.item()
                head_optimizer.zero_grad(set_to_none=True)
                loss.backward()
                head_optimizer.step()
                if d1 is not None:  # Eq. 2 on this step's G' and the client's rows
                    d1_loss = _bce(d1(fake.detach()), 0.0) + _bce(d1(real), 1.0)
                    d1_optimizer.zero_grad(set_to_none=True)
                    d1_loss.backward()
                    d1_optimizer.step()
                    losses["d1"] = d1_loss.item()
                history.append(losses)
    return SDARNeRFResult(head, time.perf_counter() - start, history)


def _auxiliary_batch(
    sampler: PixelSampler,
    rays: int,
    render_config: RenderConfig,
    config: SDARNeRFConfig,
    generator: torch.Generator,
) -> tuple[PixelBatch, RaySamples, Tensor]:
    """`rays` random auxiliary pixels, their stratified samples and their flipped colours."""
    flat = torch.randint(len(sampler.colors), (rays,), generator=generator)
    batch = sampler.pixels(flat.to(sampler.colors.device))
    samples = sample_rays(batch.rays, render_config, perturb=True)
    return batch, samples, flip_colours(batch.colors, config.flip_probability, generator)


def _bce(logits: Tensor, target: float) -> Tensor:
    """Binary cross-entropy of discriminator logits against a constant real/fake target."""
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))

"""SplitNeRF: split-learning training of a hash-grid field between a server and a client.

Paper 000, Sec. 3. The field is cut inside its density MLP: the server holds the box
normalisation, the hash-grid encoding and the first `cut_layer` density layers (Linear +
ReLU) and outputs a per-sample cut-layer embedding E; the client holds the remaining density
layer(s) and the colour head, so density and colour are produced only on the client (the
paper's requirement), together with the images and the loss. One step (Sec. 3, "Forward
Propagation" / "Backpropagation"):

1. the client draws rays and stratified samples (no occupancy grid: it cannot query density
   without the server) and sends them; the server sees points [R*S, 3], ray-major, and
   their rays (poses are public in the paper's threat model);
2. the server returns E = M_server(points) [R*S, d] (`server_forward`);
3. the client computes density and colour from E, volume-renders (Sec. 2.1 quadrature),
   takes the loss of Eq. 1 against its pixels (as the centralised trainer, averaged over
   colour channels too: Eq. 1 / 3), updates its own part and returns g_r^i = dLoss/dE_r^i
   (`client_step`, where a `ClientDefence` may perturb the targets or the returned g);
4. the server back-propagates g into its part (`server_backward`).

The server recomputes its forward pass in `server_backward` instead of keeping the graph
between messages: the server stays stateless across a round trip (what a Flower server
wants, and what lets the client pipeline its next points with its gradient reply) at the
price of one more hash-grid forward. The recomputation is exact because the server's
parameters change only after `server_backward`.

`ServerPart` and `ClientPart` share parameters with the field they split, so the joint model
stays a `HashGridField` that checkpoints and `fedfields eval` read unchanged.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedfields import atomic
from fedfields.data.pixels import PixelSampler
from fedfields.data.scene import Scene
from fedfields.devices import resolve_device
from fedfields.fields.base import FieldOutputs, normalise_to_box, trunc_exp
from fedfields.fields.hashgrid import HashGridField
from fedfields.geometry.rays import Rays, intersect_aabb
from fedfields.optim import make_optimizer
from fedfields.privacy.defences import ClientDefence
from fedfields.render.renderer import RenderConfig
from fedfields.render.samplers import stratified_bins
from fedfields.render.volume import RenderOutputs, composite_dense, dense_weights


class ServerPart(nn.Module):
    """The server's share: points -> box normalisation -> hash grid -> first density layer(s)."""

    def __init__(self, encoding: nn.Module, density_layers: nn.Sequential, aabb: Tensor) -> None:
        super().__init__()
        self.encoding = encoding
        self.density_layers = density_layers
        self.register_buffer("aabb", aabb, persistent=False)
        linear_widths = [m.out_features for m in density_layers if isinstance(m, nn.Linear)]
        self.embedding_dim: int = linear_widths[-1] if linear_widths else encoding.out_dim

    def forward(self, points: Tensor) -> Tensor:
        """Cut-layer embeddings [N, d] of world points [N, 3]."""
        return self.density_layers(self.encoding(normalise_to_box(points, self.aabb)))


class ClientPart(nn.Module):
    """The client's share: embedding -> remaining density layer(s) -> density; + SH(dir) -> rgb.

    Also the shape of the attacker's surrogate head (paper Sec. 4.1): build one from fresh
    modules with the same constructor.
    """

    def __init__(
        self, density_layers: nn.Sequential, direction_encoding: nn.Module, color_head: nn.Module
    ) -> None:
        super().__init__()
        self.density_layers = density_layers
        self.direction_encoding = direction_encoding
        self.color_head = color_head

    def forward(self, embeddings: Tensor, directions: Tensor) -> FieldOutputs:
        """Density and colour of samples from their embeddings [N, d] and unit directions [N, 3].

        The same activations as `HashGridField`: trunc_exp(f0 - 1) and a sigmoid colour.
        """
        features = self.density_layers(embeddings)
        color_input = torch.cat([features[:, 1:], self.direction_encoding(directions)], dim=-1)
        return FieldOutputs(
            density=trunc_exp(features[:, 0] - 1.0), rgb=torch.sigmoid(self.color_head(color_input))
        )


def split_field(field: HashGridField, cut_layer: int = 1) -> tuple[ServerPart, ClientPart]:
    """Cut `field` after `cut_layer` hidden density layers (paper default 1); parameters shared.

    cut_layer 0 gives the server the encoding alone. Split after moving the field to its
    device: the server part holds the field's aabb tensor itself.
    """
    head = field.density_head
    hidden_layers = (len(head) - 1) // 2  # mlp(): [Linear, ReLU] * hidden + [Linear]
    if not 0 <= cut_layer <= hidden_layers:
        raise ValueError(
            f"cut_layer must be in [0, {hidden_layers}] (the density output layer stays on "
            f"the client), got {cut_layer}"
        )
    server = ServerPart(field.encoding, head[: 2 * cut_layer], field.aabb)
    client = ClientPart(head[2 * cut_layer :], field.direction_encoding, field.color_head)
    return server, client


@dataclass
class RaySamples:
    """The client's stratified samples: rays [R, 3] and bin edges [R, S+1] along them."""

    origins: Tensor
    directions: Tensor
    edges: Tensor

    def __len__(self) -> int:
        return self.origins.shape[0]

    @property
    def mids(self) -> Tensor:
        """Sample distances [R, S]: bin midpoints."""
        return 0.5 * (self.edges[:, 1:] + self.edges[:, :-1])

    @property
    def deltas(self) -> Tensor:
        """Bin widths [R, S] used by the quadrature."""
        return self.edges[:, 1:] - self.edges[:, :-1]

    def points(self) -> Tensor:
        """Sample points [R*S, 3], ray-major: what the server's part is evaluated at."""
        points = self.origins[:, None, :] + self.mids[..., None] * self.directions[:, None, :]
        return points.reshape(-1, 3)

    def sample_directions(self) -> Tensor:
        """Each sample's ray direction [R*S, 3], ray-major."""
        samples_per_ray = self.edges.shape[1] - 1
        return self.directions.repeat_interleave(samples_per_ray, dim=0)

    def to(self, device: torch.device | str) -> RaySamples:
        """The same samples on `device`."""
        return RaySamples(
            self.origins.to(device), self.directions.to(device), self.edges.to(device)
        )


def sample_rays(rays: Rays, config: RenderConfig, perturb: bool) -> RaySamples:
    """Stratified samples in the scene box, as `render_rays` draws them without occupancy grid."""
    if config.num_importance > 0:
        raise ValueError(
            "split learning samples stratified only (the client cannot query density alone); "
            f"num_importance must be 0, got {config.num_importance}"
        )
    aabb = config.aabb_tensor.to(rays.origins.device)
    t_near, t_far = intersect_aabb(rays, aabb, config.near, config.far)
    t_far = torch.maximum(t_far, t_near + 1e-4)  # rays missing the box render the background
    edges = stratified_bins(t_near, t_far, config.num_samples, perturb)
    return RaySamples(rays.origins, rays.directions, edges)


@torch.no_grad()
def server_forward(server: ServerPart, points: Tensor) -> Tensor:
    """The server's reply to a batch of points [N, 3]: embeddings [N, d], without a graph."""
    return server(points)


def server_backward(server: ServerPart, points: Tensor, embedding_gradient: Tensor) -> None:
    """Accumulate dLoss/dtheta_server into the server's .grad from the client's dLoss/dE.

    Recomputes E = server(points) (see the module docstring); call before the server's
    optimiser step that follows the matching `server_forward`.
    """
    server(points).backward(embedding_gradient)


def render_embeddings(
    client: ClientPart, embeddings: Tensor, samples: RaySamples, background: Tensor
) -> RenderOutputs:
    """Volume-render rays from cut-layer embeddings through a client head (paper Sec. 2.1)."""
    outputs = client(embeddings, samples.sample_directions())
    shape = samples.mids.shape
    weights = dense_weights(outputs.density.view(shape), samples.deltas)
    return composite_dense(weights, outputs.rgb.view(*shape, 3), samples.mids, background)


@dataclass
class ClientStepResult:
    """A client step: its loss, its PSNR against the clean pixels, and the gradient it returns."""

    loss: float  # MSE against the targets the client optimised (after any label noise)
    psnr: float  # of the render against the clean targets
    embedding_gradient: Tensor  # [R*S, d] dLoss/dE as sent to the server (after any noise)


def client_step(
    client: ClientPart,
    embeddings: Tensor,
    samples: RaySamples,
    targets: Tensor,
    background: Tensor,
    defence: ClientDefence | None = None,
    step: int = 0,
) -> ClientStepResult:
    """Render from the server's embeddings, take the MSE, back-propagate; return dLoss/dE.

    Gradients accumulate into the client's .grad (zero them before, step the client's
    optimiser after). `defence` perturbs the targets before the loss and the gradient after.
    """
    embeddings = embeddings.detach().requires_grad_(True)
    rendered = render_embeddings(client, embeddings, samples, background)
    noisy_targets = targets if defence is None else defence.perturb_targets(targets, step)
    loss = F.mse_loss(rendered.rgb, noisy_targets)
    loss.backward()
    assert embeddings.grad is not None
    gradient = embeddings.grad
    if defence is not None:
        gradient = defence.perturb_gradient(gradient, step)
    clean_mse = F.mse_loss(rendered.rgb.detach(), targets).item()
    return ClientStepResult(
        loss=loss.item(),
        psnr=-10.0 * math.log10(max(clean_mse, 1e-10)),
        embedding_gradient=gradient,
    )


SPLIT_LEARNING_RATE = 1e-2
"""Both parts' Adam rate, in process and over Flower; decays exponentially to 0.1x by the end
(Sec. 5.1)."""
SPLIT_WEIGHT_DECAY = 1e-6
CLIENT_CHECKPOINT = "checkpoint.pt"
"""The split client's joint field, in its state directory (what the simulation's audit reads)."""
CLIENT_REPORT = "client.json"
"""The split client's held-out scores, in its state directory."""
CLIENT_RENDERS = "renders"
"""The split client's held-out renders, in its state directory."""


@dataclass
class SplitTrainConfig:
    """In-process split training: steps, batch, Adam, cut layer and what the server records."""

    steps: int
    batch_rays: int = 1024
    learning_rate: float = SPLIT_LEARNING_RATE
    weight_decay: float = SPLIT_WEIGHT_DECAY
    cut_layer: int = 1
    random_background: bool = True
    record_every: int = 0  # keep every k-th step's exchange in the transcript; 0: none
    log_every: int = 25
    device: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_rays", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.record_every < 0:
            raise ValueError(f"record_every must be >= 0, got {self.record_every}")


@dataclass
class SplitExchange:
    """One round trip as the honest-but-curious server saw it (the attack's training data)."""

    step: int
    samples: RaySamples  # the rays and sample distances the client sent; points = .points()
    embeddings: Tensor  # [R*S, d] the server's reply
    gradient: Tensor  # [R*S, d] the gradient the client returned (after any defence)


TRANSCRIPT_FORMAT = "fedfields-split-transcript-1"
TRANSCRIPT_FILE = "transcript.pt"  # a split run directory's record of the wire (`fedfields audit`)


def save_transcript(path: Path, transcript: list[SplitExchange]) -> None:
    """Write the exchanges a split server saw (rays, embeddings, returned gradients) to `path`,
    atomically so a crash leaves no half-written file; `load_transcript` reads it."""
    exchanges = [
        {
            "step": exchange.step,
            "origins": exchange.samples.origins,
            "directions": exchange.samples.directions,
            "edges": exchange.samples.edges,
            "embeddings": exchange.embeddings,
            "gradient": exchange.gradient,
        }
        for exchange in transcript
    ]
    atomic.save_torch(path, {"format": TRANSCRIPT_FORMAT, "exchanges": exchanges})


def load_transcript(path: Path) -> list[SplitExchange]:
    """The exchanges `save_transcript` wrote; ValueError if `path` holds something else."""
    payload = atomic.load_torch(path, "split transcript")
    if not isinstance(payload, dict) or payload.get("format") != TRANSCRIPT_FORMAT:
        raise ValueError(f"{path} is not a split transcript (missing format tag)")
    return [
        SplitExchange(
            int(e["step"]),
            RaySamples(e["origins"], e["directions"], e["edges"]),
            e["embeddings"],
            e["gradient"],
        )
        for e in payload["exchanges"]
    ]


@dataclass
class SplitResult:
    """What an in-process split run did: steps, seconds, curve and the server's transcript."""

    steps: int
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)
    transcript: list[SplitExchange] = field(default_factory=list)


def train_split(
    field: HashGridField,
    scene: Scene,
    config: SplitTrainConfig,
    render_config: RenderConfig,
    defence: ClientDefence | None = None,
) -> SplitResult:
    """Train `field` by SplitNeRF on `scene` in one process; server and client each run Adam.

    Every `record_every`-th exchange is kept on the CPU in the result's transcript.
    """
    torch.manual_seed(config.seed)
    device = resolve_device(config.device)
    field.to(device).train()
    scene = scene.to(device)
    server, client = split_field(field, config.cut_layer)
    optimizers = [
        make_optimizer(part, config.learning_rate, config.weight_decay) for part in (server, client)
    ]
    sampler = PixelSampler(scene, config.random_background)
    result = SplitResult(steps=0, seconds=0.0)
    start = time.perf_counter()
    for step in range(config.steps):
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
            for group in optimizer.param_groups:
                group["lr"] = config.learning_rate * 0.1 ** (step / config.steps)
        batch = sampler.sample(config.batch_rays)
        samples = sample_rays(batch.rays, render_config, perturb=True)
        points = samples.points()
        embeddings = server_forward(server, points)
        reply = client_step(
            client, embeddings, samples, batch.colors, batch.background, defence, step
        )
        if not math.isfinite(reply.loss):
            raise FloatingPointError(f"split training diverged at step {step}: loss {reply.loss}")
        server_backward(server, points, reply.embedding_gradient)
        for optimizer in optimizers:
            optimizer.step()
        result.steps += 1
        if config.record_every and step % config.record_every == 0:
            exchange = SplitExchange(
                step, samples.to("cpu"), embeddings.cpu(), reply.embedding_gradient.cpu()
            )
            result.transcript.append(exchange)
        if result.steps % config.log_every == 0:
            result.history.append(
                {
                    "step": result.steps,
                    "seconds": time.perf_counter() - start,
                    "loss": reply.loss,
                    "psnr": reply.psnr,
                }
            )
    result.seconds = time.perf_counter() - start
    return result

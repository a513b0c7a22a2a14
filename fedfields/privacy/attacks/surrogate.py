"""Surrogate Model Attack on SplitNeRF (paper 000, Sec. 4.1, Algorithm 1; scoring Sec. 5.1).

The honest-but-curious server trains a surrogate client head M_surr (the `ClientPart` shape)
and dummy pixel colours C_dummy, one per ray it saw, on the transcript of a split run:

- L_dummy = mean ||C_surr(r) - C_dummy(r)||^2 (Eq. 3, here also averaged over the three
  channels, as the client's own loss, so that the gradients below are comparable);
- g_surr = dL_dummy/dE at the recorded embeddings E, kept differentiable (create_graph);
- L_g = D(g, g_surr) against the gradient g the client returned (Eq. 2), D one minus their
  cosine similarity or the l2 norm of their difference (the paper's example);
- L_surr = lambda * L_g + L_dummy (Eq. 4), lambda re-chosen at every step and for every
  exchange so that lambda * L_g / L_dummy equals the configured ratio (Sec. 5.1);
- Adam, learning rate lr * min(1, 10/t): the "10/t" schedule, capped so that the base rate
  is the largest used.

Two attackers share these losses (`exchange_loss`):
- offline (`surrogate_model_attack`), fedfields' stronger adversary: it keeps the transcript
  and trains M_surr and one C_dummy per recorded ray for `epochs` full-batch steps over all
  of it (Algorithm 1 lines 4-9 with t an epoch, as Sec. 5.1 words it), with the deviations
  below;
- online (`online_surrogate_attack` with `paper_online_config`), the paper's attacker as
  Sec. 5.4 describes it: one Adam step per training step, t the training iteration (Table 2,
  footnote 4: "10/t decays faster ... seldom updates network parameters in the later stages
  of training"), fresh N(0, 1) dummies per batch, the l2 distance and ratio 0.01. S2NeRF's
  decaying noise (sigma_t = c max||g|| r^(t/T)) is designed against this one: its noise is
  largest exactly when the 10/t attacker learns. At the tests' scale it learns nothing,
  undefended too: its head learns to render an empty scene, whose cut-layer gradient
  vanishes (the l2 distance falls to ||g||), and its depth is no better than an untrained
  head's.

Gradient matching uses the recorded embeddings: they are exactly what the server part
computed at each step, so the attack needs no snapshots of the server's parameters. The
server's final parameters serve only to render the attacked scene (server part + surrogate),
as the depth and grey views of Sec. 5.1, scored with SSIM and, when available, LPIPS.

The offline attack's choices and deviations, each chosen on lego at 25x25 (the tests'
setting); the figures behind them, and those of the online attacker above, are in
docs/experiments/2026-11-22-splitnerf-defences.md ("Design measurements") and on
docs/BENCHMARKS.md ("Defaults, as measured"):
- D is one minus the cosine similarity; the paper's example, the l2 norm, recovers less of
  the depth, and only from U(0, 1) dummies;
- the default ratio is 100, not the paper's 0.01: with a small ratio the dummy colours
  converge to the surrogate's own renders, L_dummy and with it lambda go to 0, and the
  gradient term stops teaching the head; the paper's Table 3 also has ratio 0 best on
  SSIM-depth;
- the density layer starts in the span of the observed gradients (`spectral_init`), not at
  random: a random start recovers the depth for some seeds and nothing for others (the
  density row's sign is the trap);
- C_dummy starts N(0, 1) as in Algorithm 1, with its own learning rate (the paper gives one
  Adam for both, rate unstated).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedfields.fields.base import mlp
from fedfields.fields.encodings import SphericalHarmonicsEncoding
from fedfields.geometry.cameras import Cameras
from fedfields.geometry.rays import image_rays
from fedfields.metrics.image import lpips, psnr, ssim
from fedfields.privacy.split import (
    ClientPart,
    ServerPart,
    SplitExchange,
    render_embeddings,
    sample_rays,
    server_forward,
)
from fedfields.render.renderer import RenderConfig
from fedfields.render.volume import RenderOutputs

GREY_WEIGHTS = (0.299, 0.587, 0.114)  # ITU-R BT.601 luma


@dataclass
class SurrogateAttackConfig:
    """Surrogate Model Attack: epochs, loss ratio, Adam with the 10/t schedule, initialisation."""

    epochs: int = 60  # offline: Algorithm 1's T, full passes over the transcript, one step each
    ratio: float = 100.0  # lambda * L_g / L_dummy, held fixed (paper default 0.01; 0: L_dummy)
    learning_rate: float = 1e-2  # of the surrogate head
    dummy_learning_rate: float = 3e-2  # of the dummy colours (offline: online never reuses them)
    decay_after: float = 10.0  # lr_t = lr * min(1, decay_after / t); t: 1-based epoch (offline)
    # or training iteration (online)
    distance: Literal["l2", "cosine"] = "cosine"
    dummy_init: Literal["normal", "uniform"] = "normal"  # Algorithm 1's N(0, 1) or U(0, 1)
    head_init: Literal["spectral", "random"] = "spectral"  # see `spectral_init`
    geometry_features: int = 15  # the surrogate's shape (HashGridFieldConfig's by default)
    color_hidden: int = 64
    color_layers: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("epochs", "geometry_features", "color_hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.color_layers < 0:
            raise ValueError(f"color_layers must be >= 0, got {self.color_layers}")
        if not 0 <= self.ratio < math.inf:
            raise ValueError(f"ratio must be finite and >= 0, got {self.ratio}")
        for name in ("learning_rate", "dummy_learning_rate", "decay_after"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        choices = {
            "distance": ("l2", "cosine"),
            "dummy_init": ("uniform", "normal"),
            "head_init": ("spectral", "random"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")


@dataclass
class SurrogateResult:
    """The trained surrogate head, its loss history and the attack's wall time.

    One history record per epoch (offline: means over exchanges) or per exchange (online).
    """

    head: ClientPart
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)


def make_surrogate_head(embedding_dim: int, config: SurrogateAttackConfig) -> ClientPart:
    """A freshly initialised client-shaped head: one density layer, SH(dir), a ReLU colour MLP."""
    direction_encoding = SphericalHarmonicsEncoding()
    color_head = mlp(
        config.geometry_features + direction_encoding.out_dim,
        config.color_hidden,
        config.color_layers,
        3,
    )
    density_layers = nn.Sequential(nn.Linear(embedding_dim, 1 + config.geometry_features))
    return ClientPart(density_layers, direction_encoding, color_head)


@torch.no_grad()
def spectral_init(layer: nn.Linear, transcript: Sequence[SplitExchange]) -> None:
    """Put the surrogate density layer's rows in the span of the observed gradients.

    g = W^T dLoss/df for the client's density layer f = W E + b, so the gradients lie in W's
    row space and, density dominating, nearly along its density row w_0. The rows become the
    top right-singular vectors v_k of all observed gradients (eigenvectors of their Gram
    matrix, summed over exchanges), at the layer's initial row norm; the density row is
    s * v_1, s the sign of corr(log |g . v_1|, E . v_1), because |dLoss/df_0| =
    sigma |dLoss/dsigma| grows with sigma = exp(w_0 . E + b - 1).
    """
    gram = sum(e.gradient.double().T @ e.gradient.double() for e in transcript)
    basis = torch.linalg.eigh(gram)[1].flip(-1).T[: layer.out_features]  # largest first
    moments = torch.zeros(4, dtype=torch.float64, device=basis.device)  # n, Sx, Sy, Sxy
    for exchange in transcript:
        along = (exchange.gradient.double() @ basis[0]).abs()
        seen = along > 0
        x, y = (exchange.embeddings.double() @ basis[0])[seen], along[seen].log()
        moments += torch.stack([seen.sum(), x.sum(), y.sum(), (x * y).sum()])
    count, sum_x, sum_y, sum_xy = moments
    if sum_xy * count < sum_x * sum_y:  # negative covariance, so negative correlation
        basis[0] = -basis[0]
    rows = basis.shape[0]  # fewer than out_features when d is smaller
    layer.weight[:rows] = basis.to(layer.weight) * layer.weight.norm(dim=1).mean()


def gradient_distance(
    surrogate: Tensor, observed: Tensor, kind: Literal["l2", "cosine"] = "l2"
) -> Tensor:
    """D(g, g_surr) of Eq. 2 over all entries: ||g - g_surr||_2, or 1 - cos(g, g_surr)."""
    if kind == "l2":
        return torch.linalg.vector_norm(surrogate - observed)
    return 1.0 - F.cosine_similarity(surrogate.reshape(1, -1), observed.reshape(1, -1))[0]


def surrogate_losses(
    head: ClientPart,
    exchange: SplitExchange,
    dummy_colors: Tensor,
    background: Tensor,
    distance: Literal["l2", "cosine"] = "l2",
) -> tuple[Tensor, Tensor]:
    """(L_g, L_dummy) of Eqs. 2-3 on one recorded exchange, both differentiable."""
    embeddings = exchange.embeddings.detach().requires_grad_(True)
    rendered = render_embeddings(head, embeddings, exchange.samples, background)
    dummy_loss = F.mse_loss(rendered.rgb, dummy_colors)
    (surrogate_gradient,) = torch.autograd.grad(dummy_loss, embeddings, create_graph=True)
    return gradient_distance(surrogate_gradient, exchange.gradient, distance), dummy_loss


def balanced_loss(gradient_loss: Tensor, dummy_loss: Tensor, ratio: float) -> tuple[Tensor, float]:
    """L_surr = lambda L_g + L_dummy (Eq. 4) with lambda set so lambda L_g / L_dummy = ratio."""
    lam = ratio * dummy_loss.item() / max(gradient_loss.item(), torch.finfo(torch.float32).tiny)
    return lam * gradient_loss + dummy_loss, lam


def _on_device(transcript: Sequence[SplitExchange], device: torch.device) -> list[SplitExchange]:
    """The transcript's exchanges, their tensors moved to `device`, in the given order."""
    return [
        SplitExchange(e.step, e.samples.to(device), e.embeddings.to(device), e.gradient.to(device))
        for e in transcript
    ]


def draw_dummies(count: int, kind: Literal["normal", "uniform"], device: torch.device) -> Tensor:
    """Dummy pixel colours C_dummy [count, 3]: N(0, 1) (Algorithm 1, line 2) or U(0, 1)."""
    draw = torch.rand if kind == "uniform" else torch.randn
    return draw(count, 3, device=device)


def surrogate_adam(groups: list[dict]) -> torch.optim.Adam:
    """Adam over parameter groups that carry their own "base_lr" (torch-ngp's betas and eps)."""
    return torch.optim.Adam(groups, betas=(0.9, 0.99), eps=1e-15)


def decay_learning_rates(optimizer: torch.optim.Optimizer, t: int, decay_after: float) -> float:
    """Set every group's rate to base_lr * min(1, decay_after / t), the capped "10/t" schedule.

    Returns the factor. t is 1-based.
    """
    factor = min(1.0, decay_after / t)
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * factor
    return factor


def exchange_loss(
    head: ClientPart,
    exchange: SplitExchange,
    dummy_colors: Tensor,
    background: Tensor,
    config: SurrogateAttackConfig,
) -> tuple[Tensor, dict[str, float]]:
    """L_surr of one exchange (Eq. 4 under the ratio rule) and its record.

    The record holds L_g, L_g relative to ||g|| (the l2 distance's scale; 1 for cosine),
    L_dummy and lambda, as floats.
    """
    gradient_loss, dummy_loss = surrogate_losses(
        head, exchange, dummy_colors, background, config.distance
    )
    loss, lam = balanced_loss(gradient_loss, dummy_loss, config.ratio)
    scale = 1.0 if config.distance == "cosine" else exchange.gradient.norm().item()
    record = {
        "gradient_loss": gradient_loss.item(),
        "relative_gradient_loss": gradient_loss.item() / max(scale, 1e-30),
        "dummy_loss": dummy_loss.item(),
        "lambda": lam,
    }
    return loss, record


def surrogate_model_attack(
    server: ServerPart,
    transcript: Sequence[SplitExchange],
    background: Tensor,
    config: SurrogateAttackConfig,
) -> SurrogateResult:
    """Offline: train a surrogate head and dummy colours on the kept transcript (Algorithm 1).

    `background` ([3] or per ray) is the attacker's guess of the colour the client composited
    behind its rays. Runs on the device of the server's parameters. One history record per
    epoch: its mean over exchanges of `exchange_loss`'s record.
    """
    if not transcript:
        raise ValueError("the transcript is empty: train with record_every > 0")
    device = next(server.parameters()).device
    transcript = _on_device(transcript, device)
    background = background.to(device)
    torch.manual_seed(config.seed)
    head = make_surrogate_head(server.embedding_dim, config).to(device)
    if config.head_init == "spectral":
        spectral_init(head.density_layers[0], transcript)
    dummies = [
        draw_dummies(len(e.samples), config.dummy_init, device).requires_grad_(True)
        for e in transcript
    ]
    optimizer = surrogate_adam(
        [
            {"params": list(head.parameters()), "base_lr": config.learning_rate},
            {"params": dummies, "base_lr": config.dummy_learning_rate},
        ]
    )
    result = SurrogateResult(head=head, seconds=0.0)
    start = time.perf_counter()
    for epoch in range(1, config.epochs + 1):
        decay_learning_rates(optimizer, epoch, config.decay_after)
        optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        for exchange, dummy in zip(transcript, dummies, strict=True):
            loss, record = exchange_loss(head, exchange, dummy, background, config)
            (loss / len(transcript)).backward()
            for name, value in record.items():
                totals[name] = totals.get(name, 0.0) + value
        optimizer.step()
        record = {name: total / len(transcript) for name, total in totals.items()}
        result.history.append({"epoch": epoch, **record})
    result.seconds = time.perf_counter() - start
    return result


def paper_online_config(seed: int = 0) -> SurrogateAttackConfig:
    """The paper's 10/t-attack (Sec. 5.2, 5.4, 7.1) for `online_surrogate_attack`.

    Stated by the paper: l2 gradient distance (Eq. 2's example), loss ratio 0.01, N(0, 1)
    dummies (Algorithm 1), Adam, the 10/t schedule, a surrogate mirroring the client: one
    density layer and a three-layer colour MLP (fedfields' client's: 2 hidden layers of 64).
    Not stated, chosen here: the base rate 1e-2 (the paper's NeRF rate, Sec. 5.1) with 10/t
    read as a factor capped at 1, Adam's betas and eps (torch-ngp's, as the offline attack),
    and the head's initialisation (PyTorch's default: the paper only says "initialize").
    """
    return SurrogateAttackConfig(
        ratio=0.01,
        learning_rate=1e-2,
        decay_after=10.0,
        distance="l2",
        dummy_init="normal",
        head_init="random",
        seed=seed,
    )


def online_surrogate_attack(
    server: ServerPart,
    transcript: Sequence[SplitExchange],
    background: Tensor,
    config: SurrogateAttackConfig,
) -> SurrogateResult:
    """Online: one Adam step on the surrogate head per exchange, in training order (Sec. 5.4).

    The paper's attacker runs beside training: its iteration t is the training iteration
    (Table 2's caption; footnote 4's T ~ 60,000 is NeRF's step count), so an exchange with
    0-based `step` is visited at t = step + 1, sorted by step whatever the transcript's
    order. The rate is lr * min(1, decay_after / t): "10/t" read as a factor on the base rate,
    like the paper's other schemes 0.1^(t/T), capped at 1 so that it never exceeds the base.
    t is the training iteration also when only every k-th exchange was recorded: the
    schedule follows training time, and the attacker simply misses the other steps.

    Each exchange gets fresh dummy colours (`config.dummy_init`), drawn after the head's
    initialisation from the global generator seeded with `config.seed`. Algorithm 1 updates
    M_surr and C_dummy together (lines 8-9), both from the same L_surr: the head's step at t
    uses the dummies as drawn, and the dummies' own update could only matter at a later t,
    where a fresh batch brings fresh dummies. So it cannot change the head and is not made
    (`config.dummy_learning_rate` and `config.epochs` are unused here). With
    `head_init="spectral"` the density layer is initialised from the first exchange only,
    all an online attacker has at t = 1. One history record per exchange: its step, t, the
    head's rate and `exchange_loss`'s record.
    """
    if not transcript:
        raise ValueError("the transcript is empty: train with record_every > 0")
    steps = [e.step for e in transcript]
    if len(set(steps)) != len(steps):
        raise ValueError("the transcript repeats a training step")
    device = next(server.parameters()).device
    ordered = _on_device(sorted(transcript, key=lambda e: e.step), device)
    background = background.to(device)
    torch.manual_seed(config.seed)
    head = make_surrogate_head(server.embedding_dim, config).to(device)
    if config.head_init == "spectral":
        spectral_init(head.density_layers[0], ordered[:1])
    optimizer = surrogate_adam(
        [{"params": list(head.parameters()), "base_lr": config.learning_rate}]
    )
    result = SurrogateResult(head=head, seconds=0.0)
    start = time.perf_counter()
    for exchange in ordered:
        t = exchange.step + 1
        factor = decay_learning_rates(optimizer, t, config.decay_after)
        dummies = draw_dummies(len(exchange.samples), config.dummy_init, device)
        optimizer.zero_grad(set_to_none=True)
        loss, record = exchange_loss(head, exchange, dummies, background, config)
        loss.backward()
        optimizer.step()
        lr = config.learning_rate * factor
        result.history.append({"step": exchange.step, "t": t, "lr": lr, **record})
    result.seconds = time.perf_counter() - start
    return result


@torch.no_grad()
def render_split_view(
    server: ServerPart,
    head: ClientPart,
    cameras: Cameras,
    view: int,
    render_config: RenderConfig,
) -> RenderOutputs:
    """One view of server part + head, stratified samples as in training; [H, W(, 3)]."""
    device = next(server.parameters()).device
    rays = image_rays(cameras.to(device), view)
    background = torch.tensor(render_config.background, device=device)
    parts = []
    for start in range(0, len(rays), render_config.chunk):
        samples = sample_rays(rays[start : start + render_config.chunk], render_config, False)
        embeddings = server_forward(server, samples.points())
        parts.append(render_embeddings(head, embeddings, samples, background))
    height, width = cameras.height, cameras.width
    return RenderOutputs(
        rgb=torch.cat([p.rgb for p in parts]).view(height, width, 3),
        depth=torch.cat([p.depth for p in parts]).view(height, width),
        opacity=torch.cat([p.opacity for p in parts]).view(height, width),
    )


def depth_view(rendered: RenderOutputs, render_config: RenderConfig) -> Tensor:
    """Depth image [H, W] in [0, 1]: sum_i w_i (t_i - near) / (far - near), 0 where empty.

    torch-ngp's depth (the paper's implementation) with the scene's fixed near and far
    rather than per-image min-max, so attacked and true depths share one scale and an empty
    render is black.
    """
    span = render_config.far - render_config.near
    return ((rendered.depth - rendered.opacity * render_config.near) / span).clamp(0.0, 1.0)


def grey_view(rgb: Tensor) -> Tensor:
    """Grey image [H, W] (BT.601 luma) of an RGB image [H, W, 3]."""
    return (rgb * rgb.new_tensor(GREY_WEIGHTS)).sum(-1).clamp(0.0, 1.0)


def render_depth_and_grey(
    server: ServerPart,
    head: ClientPart,
    cameras: Cameras,
    view: int,
    render_config: RenderConfig,
) -> tuple[Tensor, Tensor]:
    """Depth and grey images [H, W] in [0, 1] of one view of server part + head (Sec. 5.1)."""
    rendered = render_split_view(server, head, cameras, view, render_config)
    return depth_view(rendered, render_config), grey_view(rendered.rgb)


def _as_images(views: list[Tensor]) -> np.ndarray:
    """[N, H, W, C] numpy batch of views; single-channel views repeated to three channels."""
    batch = torch.stack(views).cpu().numpy()
    return np.repeat(batch[..., None], 3, axis=-1) if batch.ndim == 3 else batch


def score_attack(
    server: ServerPart,
    surrogate: ClientPart,
    client: ClientPart,
    cameras: Cameras,
    views: Sequence[int],
    render_config: RenderConfig,
) -> dict[str, float | None]:
    """Leakage: server + surrogate renders against the client's true joint model's, view mean.

    SSIM-depth, SSIM-grey, LPIPS-depth, LPIPS-grey (None without the lpips package) and the
    PSNR of the colour renders (the scene-aided attack's metric, Sec. 5.3).
    """
    attacked = [render_split_view(server, surrogate, cameras, v, render_config) for v in views]
    truth = [render_split_view(server, client, cameras, v, render_config) for v in views]
    depth = [_as_images([depth_view(r, render_config) for r in rs]) for rs in (attacked, truth)]
    grey = [_as_images([grey_view(r.rgb) for r in rs]) for rs in (attacked, truth)]
    colour = [_as_images([r.rgb for r in rs]) for rs in (attacked, truth)]
    return {
        "ssim_depth": ssim(*depth),
        "ssim_grey": ssim(*grey),
        "lpips_depth": lpips(*depth),
        "lpips_grey": lpips(*grey),
        "psnr": psnr(*colour),
    }

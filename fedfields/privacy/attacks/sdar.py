"""SDAR: the simulator-decoder attack with adversarial regularisation on split learning (paper 001).

Threat model (Sec. III): an honest-but-curious server follows the split-learning protocol,
holds a labelled auxiliary data set D' from the client's domain (disjoint from the client's
D) and knows the architecture of the client's part, never its parameters. `SDARAttack`
runs alongside training: after each protocol step the server hands it a
`SplitStepRecord` (what it received and its own part's parameters) and the attack takes one
step of its own, as in the paper's Figs. 14-15.

Vanilla split learning (Sec. IV-A, Fig. 14): the client computes Z_s = f(X) and sends
(Z_s, Y); the server holds g and the labels. With its copy of g frozen, on an auxiliary batch
(X', Y') with Z_s' = f~(X'):

- simulator f~: L = l(g(Z_s'), Y') + lambda_1 * BCE(d1(Z_s', Y'), 1)                  (Eq. 3)
- d1:           L = BCE(d1(Z_s', Y'), 0) + BCE(d1(Z_s, Y), 1)                          (Eq. 2)
- decoder f~^-1: L = MSE(X', f~^-1(Z_s', Y')) + lambda_2 * BCE(d2(f~^-1(Z_s, Y), Y), 1) (Eq. 5)
- d2:           L = BCE(d2(f~^-1(Z_s, Y), Y), 0) + BCE(d2(X', Y'), 1)                 (Eq. 4)

The labels condition the decoder and both discriminators, cGAN style ("Use of labels"; see
`LabelConditioned`). U-shaped split learning (Sec. IV-B, Fig. 15): the client keeps f and
the top h with the labels, the server sees Z_s only and holds the middle g. A second
simulator h~ is trained with f~ on l(h~(g(f~(X'))), Y~'), each auxiliary label flipped to a
uniformly drawn one with probability p; nothing is conditioned; the private labels are
inferred as argmax h~(g(Z_s)). The reconstruction is X^ = f~^-1(Z_s) in both settings.

Hyper-parameters (Appendix B-C, Table VII): lambda_1 = 0.02, lambda_2 = 1e-5, Adam with the
simulators at the task's learning rate eta, the decoder at eta / 2 and the discriminators at
lambda_i * eta. The naive simulator-decoder attack (naive SDA, Sec. IV-A; the paper's
ablation) is `SDARConfig.naive()`: no discriminators, no conditioning, no label flipping.

The attack never holds the client's parameters or private inputs: it is built from fresh
models (`AttackerModels`), a template of the server's own part and the auxiliary data, and
fed only `SplitStepRecord`s, whose smashed data carry no autograd graph back into f.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn

from fedfields import atomic


@dataclass(frozen=True)
class SDARConfig:
    """SDAR's weights, label flipping and learning rates (paper 001, Table VII and App. B-C)."""

    lambda1: float = 0.02  # simulator's adversarial weight (Eq. 3)
    lambda2: float = 1e-5  # decoder's adversarial weight (Eq. 5)
    flip_probability: float = 0.2  # U-shaped only: p of the random label flip (Sec. IV-B)
    conditional: bool = True  # vanilla only: condition decoder and discriminators on labels
    learning_rate: float = 1e-3  # simulators f~ and h~ (the task's eta)
    weight_decay: float = 0.0  # l2 on the simulators, to mirror a client l2 defence (Sec. VI)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.lambda1 < 0 or self.lambda2 < 0:
            raise ValueError(f"lambdas must be >= 0, got {self.lambda1}, {self.lambda2}")
        if not 0 <= self.flip_probability <= 1:
            raise ValueError(f"flip_probability must be in [0, 1], got {self.flip_probability}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")

    @classmethod
    def naive(cls, **overrides: float | int) -> SDARConfig:
        """Naive SDA (Sec. IV-A): the same simulator and decoder without any regularisation."""
        return cls(lambda1=0.0, lambda2=0.0, flip_probability=0.0, conditional=False, **overrides)

    @property
    def decoder_learning_rate(self) -> float:
        """Half the simulator's (App. B-C)."""
        return self.learning_rate / 2

    @property
    def discriminator_learning_rates(self) -> tuple[float, float]:
        """lambda_1 * eta for d1 and lambda_2 * eta for d2 (App. B-C)."""
        return self.lambda1 * self.learning_rate, self.lambda2 * self.learning_rate


@dataclass(frozen=True)
class SplitStepRecord:
    """What the server saw at one split-learning step, all the attack may use.

    `smashed` is Z_s = f(X) as received (detached: no graph into the client's f);
    `server_state` is the server part's state dict after its update at this step; `labels`
    are the Y the client sent with Z_s in vanilla split learning and None in U-shaped.
    """

    smashed: Tensor
    server_state: dict[str, Tensor]
    labels: Tensor | None = None

    def __post_init__(self) -> None:
        if self.smashed.requires_grad:
            raise ValueError("smashed data must be detached: the server gets values, not a graph")
        if self.labels is not None and len(self.labels) != len(self.smashed):
            raise ValueError(f"{len(self.labels)} labels for {len(self.smashed)} smashed rows")


@dataclass
class AttackerModels:
    """The server's own, freshly initialised models: simulators, decoder, discriminators.

    d1 is needed when lambda_1 > 0 and d2 when lambda_2 > 0; `top_simulator` (h~) makes the
    attack U-shaped. With `SDARConfig.conditional` in vanilla split learning the decoder and
    the discriminators are called as module(x, labels) (see `LabelConditioned`).
    """

    simulator: nn.Module
    decoder: nn.Module
    representation_discriminator: nn.Module | None = None
    input_discriminator: nn.Module | None = None
    top_simulator: nn.Module | None = None


class LabelConditioned(nn.Module):
    """Feeds `inner` its input with one more channel, a learned map of the label (cGAN style)."""

    def __init__(
        self,
        inner: nn.Module,
        num_classes: int,
        input_shape: tuple[int, ...],
        embedding_dim: int = 50,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.embedding = nn.Embedding(num_classes, embedding_dim)
        self.project = nn.Linear(embedding_dim, math.prod(input_shape[1:]))
        self.map_shape = (1, *input_shape[1:])

    def forward(self, x: Tensor, labels: Tensor) -> Tensor:
        """inner(concat(x, label map)) along the channel dimension."""
        label_map = self.project(self.embedding(labels)).view(-1, *self.map_shape)
        return self.inner(torch.cat([x, label_map], dim=1))


class SDARAttack:
    """SDAR (or naive SDA) run by the server alongside split learning, one step per record."""

    def __init__(
        self,
        models: AttackerModels,
        server_part: nn.Module,
        aux_inputs: Tensor,
        aux_labels: Tensor,
        num_classes: int,
        config: SDARConfig | None = None,
    ) -> None:
        self.config = config or SDARConfig()
        if (models.representation_discriminator is None) == (self.config.lambda1 > 0):
            raise ValueError("give a representation discriminator d1 exactly when lambda1 > 0")
        if (models.input_discriminator is None) == (self.config.lambda2 > 0):
            raise ValueError("give an input discriminator d2 exactly when lambda2 > 0")
        if len(aux_inputs) != len(aux_labels):
            raise ValueError(f"{len(aux_labels)} auxiliary labels for {len(aux_inputs)} inputs")
        self.models = models
        self.u_shaped = models.top_simulator is not None
        self.conditional = self.config.conditional and not self.u_shaped
        self.server_part = copy.deepcopy(server_part).eval().requires_grad_(False)
        self.aux_inputs = aux_inputs
        self.aux_labels = aux_labels
        self.num_classes = num_classes
        self.generator = torch.Generator().manual_seed(self.config.seed)
        simulators = [models.simulator] + ([models.top_simulator] if self.u_shaped else [])
        self.simulator_optimizer = torch.optim.Adam(
            [p for m in simulators for p in m.parameters()],
            lr=self.config.learning_rate,
            weight_decay=self.config.weight_decay,
        )
        self.decoder_optimizer = torch.optim.Adam(
            models.decoder.parameters(), lr=self.config.decoder_learning_rate
        )
        d1_lr, d2_lr = self.config.discriminator_learning_rates
        self.d1 = _with_adam(models.representation_discriminator, d1_lr)
        self.d2 = _with_adam(models.input_discriminator, d2_lr)
        self.history: list[dict[str, float]] = []

    def observe(self, record: SplitStepRecord) -> dict[str, float]:
        """One attack step on the record (Fig. 14 lines 22-33, Fig. 15 lines 27-41); its losses."""
        if self.u_shaped != (record.labels is None):
            raise ValueError("vanilla records carry labels, U-shaped records do not")
        self.server_part.load_state_dict(record.server_state)
        batch = len(record.smashed)
        index = torch.randint(len(self.aux_inputs), (batch,), generator=self.generator)
        x_aux, y_aux = self.aux_inputs[index], self.aux_labels[index]
        y_task = self._flip(y_aux) if self.u_shaped else y_aux
        aux_condition = y_aux if self.conditional else None
        private_condition = record.labels if self.conditional else None
        # Dropout draws from the global generator: fork it, seeded from the attack's own, so
        # the attack neither perturbs the training it watches nor depends on it.
        device = self.aux_inputs.device
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
            torch.manual_seed(int(torch.randint(2**62, (), generator=self.generator)))
            simulated, losses = self._simulator_step(
                x_aux, y_task, record.smashed, aux_condition, private_condition
            )
            losses |= self._decoder_step(
                x_aux, simulated, record.smashed, aux_condition, private_condition
            )
        self.history.append(losses)
        return losses

    @torch.no_grad()
    def reconstruct(self, smashed: Tensor, labels: Tensor | None = None) -> Tensor:
        """X^ = f~^-1(Z_s) (vanilla with conditioning: f~^-1(Z_s, Y), labels required)."""
        if self.conditional and labels is None:
            raise ValueError("the conditional decoder needs the labels the server received")
        decoder = self.models.decoder.eval()
        reconstruction = _call(decoder, smashed, labels if self.conditional else None)
        decoder.train()
        return reconstruction

    @torch.no_grad()
    def infer_labels(self, smashed: Tensor) -> Tensor:
        """U-shaped label inference Y^ = argmax h~(g(Z_s)) (Fig. 15 line 44)."""
        if self.models.top_simulator is None:
            raise ValueError("label inference is for U-shaped split learning")
        top = self.models.top_simulator.eval()
        labels = top(self.server_part(smashed)).argmax(dim=1)
        top.train()
        return labels

    def _flip(self, labels: Tensor) -> Tensor:
        """Replace each label by a uniform one with probability p (Sec. IV-B)."""
        flip = torch.rand(len(labels), generator=self.generator) < self.config.flip_probability
        random = torch.randint(self.num_classes, labels.shape, generator=self.generator)
        return torch.where(flip.to(labels.device), random.to(labels.device), labels)

    def _simulator_step(
        self,
        x_aux: Tensor,
        y_task: Tensor,
        smashed: Tensor,
        aux_condition: Tensor | None,
        private_condition: Tensor | None,
    ) -> tuple[Tensor, dict[str, float]]:
        """Update f~ (and h~) by Eq. 3, then d1 by Eq. 2; returns the step's Z_s' and losses."""
        simulated = self.models.simulator(x_aux)
        logits = self.server_part(simulated)
        if self.models.top_simulator is not None:
            logits = self.models.top_simulator(logits)
        task_loss = F.cross_entropy(logits, y_task)
        losses = {"task": task_loss.item()}
        loss = task_loss
        if self.d1 is not None:
            adversarial = _bce(_call(self.d1[0], simulated, aux_condition), 1.0)
            loss = loss + self.config.lambda1 * adversarial
            losses["simulator_adversarial"] = adversarial.item()
        self.simulator_optimizer.zero_grad()
        loss.backward()
        self.simulator_optimizer.step()
        simulated = simulated.detach()
        if self.d1 is not None:
            d1, optimizer = self.d1
            d1_loss = _bce(_call(d1, simulated, aux_condition), 0.0) + _bce(
                _call(d1, smashed, private_condition), 1.0
            )
            optimizer.zero_grad()
            d1_loss.backward()
            optimizer.step()
            losses["d1"] = d1_loss.item()
        return simulated, losses

    def _decoder_step(
        self,
        x_aux: Tensor,
        simulated: Tensor,
        smashed: Tensor,
        aux_condition: Tensor | None,
        private_condition: Tensor | None,
    ) -> dict[str, float]:
        """Update f~^-1 by Eq. 5 on the step's Z_s' (Fig. 14 line 24), then d2 by Eq. 4."""
        decoder = self.models.decoder
        mse = F.mse_loss(_call(decoder, simulated, aux_condition), x_aux)
        losses = {"decoder_mse": mse.item()}
        loss = mse
        if self.d2 is not None:
            decoded_private = _call(decoder, smashed, private_condition)
            adversarial = _bce(_call(self.d2[0], decoded_private, private_condition), 1.0)
            loss = loss + self.config.lambda2 * adversarial
            losses["decoder_adversarial"] = adversarial.item()
        self.decoder_optimizer.zero_grad()
        loss.backward()
        self.decoder_optimizer.step()
        if self.d2 is not None:
            d2, optimizer = self.d2
            d2_loss = _bce(_call(d2, decoded_private.detach(), private_condition), 0.0) + _bce(
                _call(d2, x_aux, aux_condition), 1.0
            )
            optimizer.zero_grad()
            d2_loss.backward()
            optimizer.step()
            losses["d2"] = d2_loss.item()
        return losses


@dataclass
class SDARAuditReport:
    """An audit's attack MSE, U-shaped label accuracy, reconstructions and figure path."""

    mse: float
    label_accuracy: float | None
    reconstructions: Tensor
    png: Path
    history: list[dict[str, float]]


def run_sdar_audit(
    attack: SDARAttack,
    transcript: Iterable[SplitStepRecord],
    target: SplitStepRecord,
    private_inputs: Tensor,
    png: Path,
    private_labels: Tensor | None = None,
    max_images: int = 16,
) -> SDARAuditReport:
    """Replay a recorded transcript into the attack, then reconstruct and score `target`.

    `target` holds the smashed data (and, vanilla, labels) of `private_inputs`; the private
    inputs and `private_labels` serve only to score the attack and draw the PNG (first row:
    private inputs, second row: their reconstructions), never to train it.
    """
    for record in transcript:
        attack.observe(record)
    reconstructions = attack.reconstruct(target.smashed, target.labels)
    mse = F.mse_loss(reconstructions, private_inputs).item()
    label_accuracy = None
    if attack.u_shaped and private_labels is not None:
        inferred = attack.infer_labels(target.smashed)
        label_accuracy = (inferred == private_labels).float().mean().item()
    save_reconstruction_png(private_inputs[:max_images], reconstructions[:max_images], png)
    return SDARAuditReport(mse, label_accuracy, reconstructions, png, list(attack.history))


def save_reconstruction_png(originals: Tensor, reconstructions: Tensor, png: Path) -> Path:
    """Two rows of [N, C, H, W] images in [0, 1], upscaled to at least 64 pixels a side."""
    rows = torch.cat([_row(originals), _row(reconstructions)], dim=0)
    scale = max(1, math.ceil(64 / originals.shape[-2]))
    pixels = (rows.clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    pixels = np.kron(pixels, np.ones((scale, scale, 1), dtype=np.uint8))
    png.parent.mkdir(parents=True, exist_ok=True)
    atomic.save_image(png, Image.fromarray(pixels.squeeze(-1) if pixels.shape[-1] == 1 else pixels))
    return png


def _row(images: Tensor) -> Tensor:
    """[N, C, H, W] -> [H, N * W, C], one pixel of white between images."""
    padded = F.pad(images.detach().float().cpu(), (0, 1, 0, 1), value=1.0)
    return padded.permute(2, 0, 3, 1).reshape(padded.shape[2], -1, padded.shape[1])


def _call(module: nn.Module, x: Tensor, labels: Tensor | None) -> Tensor:
    """module(x), or module(x, labels) for a label-conditioned module."""
    return module(x) if labels is None else module(x, labels)


def _bce(logits: Tensor, target: float) -> Tensor:
    """Binary cross-entropy of discriminator logits against a constant real/fake target."""
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


def _with_adam(
    module: nn.Module | None, learning_rate: float
) -> tuple[nn.Module, torch.optim.Adam] | None:
    """A discriminator with its Adam, or None when the attack runs without it."""
    return (
        None
        if module is None
        else (module, torch.optim.Adam(module.parameters(), lr=learning_rate))
    )

"""The SDAR audit on scikit-learn's digits: a small split CNN trained while the attacks watch.

Task (issue 8): `load_digits` (1,797 grey 8x8 digits, 10 classes) scaled to [0, 1] and split
with a seeded permutation into a test set and two disjoint halves of the rest: the client's
private data D and the server's labelled auxiliary data D' (paper 001, Sec. III).

Model: paper 001's PlainNet (Fig. 16b) scaled down to 8x8 inputs: four blocks of 3x3
convolution + batch norm + ReLU (16, 32, 32, 64 channels; the second and fourth with stride
2), then global average pooling, dropout and a linear classifier. The client holds the first
`split_level` blocks (f). Vanilla: the server holds the rest with the classifier (g).
U-shaped: the server holds the remaining blocks (g) and the client the pooled classifier (h).
Split learning uses Adam at eta = 1e-3 for every party (paper App. B-B; batch 32 here). The
parts are initialised in network order and split gradients are exact, so a seed trains the
same joint model at every cut: the cut changes what the server sees, not the utility.
The defences of Sec. VI: dropout before the classifier and an l2 penalty l2 * ||w||^2 on
every party's weights (Adam's weight_decay = 2 * l2).

Attacker models (App. B-C, scaled down): the simulator f~ (and h~) have the client's
architecture with their own initialisation; the decoder mirrors f block by block (upsampling
+ convolution where f strides, against checkerboard artefacts) and ends in a sigmoid; d1 and
d2 are small LeakyReLU convolutional discriminators with batch norm and dropout 0.4 before
the logit. Conditioning on labels (vanilla) goes through `LabelConditioned`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import Tensor, nn

from fedfields.privacy.attacks.sdar import (
    AttackerModels,
    LabelConditioned,
    SDARAttack,
    SDARConfig,
    SplitStepRecord,
    save_reconstruction_png,
)

NUM_CLASSES = 10
IMAGE_SHAPE = (1, 8, 8)
BLOCKS = ((1, 16, 1), (16, 32, 2), (32, 32, 1), (32, 64, 2))  # (in, out, stride) per block
SPLIT_LEVELS = (1, 2, 3)  # client blocks; level 4 would leave g empty in U-shaped SL
U_SHAPED_SDAR = SDARConfig(lambda1=0.4, flip_probability=0.2)
"""SDAR against U-shaped SL on digits, picked from paper 001's U-shaped grid (App. B-C:
lambda_1 in {0.2, 0.4}, p in {0.1, 0.2, 0.4}) at two client blocks (whole grid on seed 0,
three candidates on seeds 0-2) for label accuracy and MSE together. Table VII's
lambda_1 = 0.02-0.04 leaves d1 (learning rate lambda_1 * eta) too slow for the few hundred
steps run here, and h~ then learns a permutation of the classes."""


@dataclass
class DigitsData:
    """The client's private digits, the server's auxiliary digits and a test set, in [0, 1]."""

    private_inputs: Tensor
    private_labels: Tensor
    aux_inputs: Tensor
    aux_labels: Tensor
    test_inputs: Tensor
    test_labels: Tensor


def load_digits_split(seed: int = 0, test_fraction: float = 0.2) -> DigitsData:
    """Seeded split of load_digits: test set, then disjoint private and auxiliary halves."""
    digits = load_digits()
    inputs = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    num_test = round(test_fraction * len(labels))
    test, rest = order[:num_test], order[num_test:]
    private, aux = rest[: len(rest) // 2], rest[len(rest) // 2 :]
    return DigitsData(
        inputs[private], labels[private], inputs[aux], labels[aux], inputs[test], labels[test]
    )


@dataclass
class DigitsSplitConfig:
    """Split level, vanilla or U-shaped, split-learning budget and the Sec. VI defences."""

    split_level: int = 2
    u_shaped: bool = False
    steps: int = 600
    batch_size: int = 32
    learning_rate: float = 1e-3
    dropout: float = 0.0
    l2: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.split_level not in SPLIT_LEVELS:
            raise ValueError(f"split_level must be one of {SPLIT_LEVELS}, got {self.split_level}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.l2 < 0:
            raise ValueError(f"l2 must be >= 0, got {self.l2}")


def conv_blocks(first: int, last: int) -> nn.Sequential:
    """Blocks first..last-1 of the CNN: 3x3 convolution, batch norm, ReLU."""
    layers: list[nn.Module] = []
    for in_channels, out_channels, stride in BLOCKS[first:last]:
        layers += [
            nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(),
        ]
    return nn.Sequential(*layers)


def classifier(dropout: float) -> nn.Sequential:
    """Global average pooling, dropout (the Sec. VI defence) and the linear classifier."""
    return nn.Sequential(
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(BLOCKS[-1][1], NUM_CLASSES),
    )


@dataclass
class SplitCNN:
    """The client's bottom f, the server's part g and, U-shaped, the client's top h."""

    bottom: nn.Sequential
    middle: nn.Sequential
    top: nn.Sequential | None

    def predict(self, inputs: Tensor) -> Tensor:
        """Class logits of the joint model."""
        output = self.middle(self.bottom(inputs))
        return output if self.top is None else self.top(output)

    def parts(self) -> list[nn.Module]:
        """Every part, client's and server's."""
        return [self.bottom, self.middle] + ([] if self.top is None else [self.top])


def split_cnn(config: DigitsSplitConfig) -> SplitCNN:
    """The digits CNN cut after `split_level` blocks (and before the classifier if U-shaped)."""
    bottom = conv_blocks(0, config.split_level)
    rest = conv_blocks(config.split_level, len(BLOCKS))
    if config.u_shaped:
        return SplitCNN(bottom, rest, classifier(config.dropout))
    return SplitCNN(bottom, nn.Sequential(*rest, *classifier(config.dropout)), None)


def representation_shape(split_level: int) -> tuple[int, int, int]:
    """Shape of the smashed data Z_s = f(X) of one image at this split level."""
    size = IMAGE_SHAPE[-1]
    for _, _, stride in BLOCKS[:split_level]:
        size //= stride
    return BLOCKS[split_level - 1][1], size, size


def decoder(split_level: int, conditional: bool) -> nn.Module:
    """f~^-1: f's blocks in reverse (upsample + conv where f strides), then a sigmoid image."""
    shape = representation_shape(split_level)
    channels = shape[0] + int(conditional)
    layers: list[nn.Module] = []
    for in_channels, _, stride in reversed(BLOCKS[:split_level]):
        width = max(in_channels, 16)
        if stride == 2:
            layers.append(nn.Upsample(scale_factor=2))
        layers += [nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
        channels = width
    layers += [nn.Conv2d(channels, IMAGE_SHAPE[0], 3, padding=1), nn.Sigmoid()]
    return _conditioned(nn.Sequential(*layers), shape, conditional)


def discriminator(shape: tuple[int, int, int], conditional: bool) -> nn.Module:
    """d1 or d2: LeakyReLU convolutions halving the map down to 2x2, dropout 0.4, one logit."""
    channels, size = shape[0] + int(conditional), shape[-1]
    layers: list[nn.Module] = [nn.Conv2d(channels, 16, 3, padding=1), nn.LeakyReLU(0.2)]
    channels = 16
    while size > 2:
        layers += [
            nn.Conv2d(channels, 32, 3, stride=2, padding=1),
            nn.BatchNorm2d(32),
            nn.LeakyReLU(0.2),
        ]
        channels, size = 32, size // 2
    layers += [nn.Flatten(), nn.Dropout(0.4), nn.Linear(channels * size * size, 1)]
    return _conditioned(nn.Sequential(*layers), shape, conditional)


def attacker_models(config: DigitsSplitConfig, attack: SDARConfig) -> AttackerModels:
    """The server's fresh simulator(s), decoder and the discriminators its lambdas call for."""
    conditional = attack.conditional and not config.u_shaped
    shape = representation_shape(config.split_level)
    return AttackerModels(
        simulator=conv_blocks(0, config.split_level),
        decoder=decoder(config.split_level, conditional),
        representation_discriminator=discriminator(shape, conditional)
        if attack.lambda1 > 0
        else None,
        input_discriminator=discriminator(IMAGE_SHAPE, conditional) if attack.lambda2 > 0 else None,
        top_simulator=classifier(config.dropout) if config.u_shaped else None,
    )


def train_split_digits(
    model: SplitCNN,
    data: DigitsData,
    config: DigitsSplitConfig,
    observers: Sequence[Callable[[SplitStepRecord], object]] = (),
) -> float:
    """Split learning on the private digits, each step's record handed to the observers.

    The server part sees only detached smashed data and returns only the gradient at the
    cut (U-shaped: it sends g(Z_s) and receives the gradient at g's output); observers get
    the server's view after its update. Returns the joint model's test accuracy.
    """
    generator = torch.Generator().manual_seed(config.seed)
    client_modules = [model.bottom] + ([] if model.top is None else [model.top])
    client_optimizer = _adam(client_modules, config)
    server_optimizer = _adam([model.middle], config)
    for part in model.parts():
        part.train()
    for _ in range(config.steps):
        index = torch.randint(len(data.private_inputs), (config.batch_size,), generator=generator)
        inputs, labels = data.private_inputs[index], data.private_labels[index]
        smashed = model.bottom(inputs)
        received = smashed.detach().requires_grad_()
        server_output = model.middle(received)
        server_optimizer.zero_grad()
        client_optimizer.zero_grad()
        if model.top is None:
            F.cross_entropy(server_output, labels).backward()
        else:
            returned = server_output.detach().requires_grad_()
            F.cross_entropy(model.top(returned), labels).backward()
            server_output.backward(returned.grad)
        server_optimizer.step()
        smashed.backward(received.grad)
        client_optimizer.step()
        record = SplitStepRecord(
            smashed=smashed.detach(),
            server_state={k: v.detach().clone() for k, v in model.middle.state_dict().items()},
            labels=None if config.u_shaped else labels,
        )
        for observe in observers:
            observe(record)
    return accuracy_on_test_set(model, data)


@torch.no_grad()
def accuracy_on_test_set(model: SplitCNN, data: DigitsData) -> float:
    """Accuracy of the joint model on the held-out digits (the utility of split learning)."""
    for part in model.parts():
        part.eval()
    predictions = model.predict(data.test_inputs).argmax(dim=1)
    return (predictions == data.test_labels).float().mean().item()


@dataclass
class AttackScore:
    """One attack's leakage on the private digits, before and after watching training."""

    mse: float
    untrained_mse: float
    label_accuracy: float | None
    history: list[dict[str, float]]


@dataclass
class DigitsAuditResult:
    """Utility, a data-only baseline and every attack's leakage, with the models for checks."""

    test_accuracy: float
    mean_image_mse: float  # predicting the auxiliary mean digit for every private one
    class_mean_mse: float  # predicting the auxiliary mean digit of each private digit's class
    scores: dict[str, AttackScore]
    model: SplitCNN
    attacks: dict[str, SDARAttack]
    data: DigitsData
    pngs: dict[str, Path] = field(default_factory=dict)


def digits_audit(
    config: DigitsSplitConfig,
    attacks: Mapping[str, SDARConfig],
    data: DigitsData | None = None,
    png_dir: Path | None = None,
) -> DigitsAuditResult:
    """Train the split CNN once while every named attack observes it; score them all.

    Leakage is scored on the client's smashed data of all its private digits under the
    final f (the attack MSE of Sec. V), with the labels the server holds in vanilla SL, and
    as the U-shaped label accuracy; with `png_dir`, writes <name>.png per attack (first row
    private digits, second their reconstructions).
    """
    data = data or load_digits_split(config.seed)
    torch.manual_seed(config.seed)
    model = split_cnn(config)
    sdar_attacks: dict[str, SDARAttack] = {}
    for offset, (name, attack_config) in enumerate(attacks.items()):
        torch.manual_seed(config.seed + 1000 * (offset + 1))
        sdar_attacks[name] = SDARAttack(
            attacker_models(config, attack_config),
            model.middle,
            data.aux_inputs,
            data.aux_labels,
            NUM_CLASSES,
            attack_config,
        )
    untrained = {name: copy.deepcopy(attack) for name, attack in sdar_attacks.items()}
    accuracy = train_split_digits(
        model, data, config, [attack.observe for attack in sdar_attacks.values()]
    )
    model.bottom.eval()
    with torch.no_grad():
        smashed = model.bottom(data.private_inputs)
    labels = None if config.u_shaped else data.private_labels  # what the server holds
    scores: dict[str, AttackScore] = {}
    pngs: dict[str, Path] = {}
    for name, attack in sdar_attacks.items():
        reconstructions = attack.reconstruct(smashed, labels)
        label_accuracy = None
        if config.u_shaped:
            inferred = attack.infer_labels(smashed)
            label_accuracy = (inferred == data.private_labels).float().mean().item()
        scores[name] = AttackScore(
            F.mse_loss(reconstructions, data.private_inputs).item(),
            F.mse_loss(untrained[name].reconstruct(smashed, labels), data.private_inputs).item(),
            label_accuracy,
            attack.history,
        )
        if png_dir is not None:
            pngs[name] = save_reconstruction_png(
                data.private_inputs[:16], reconstructions[:16], png_dir / f"{name}.png"
            )
    mean_image = data.aux_inputs.mean(dim=0, keepdim=True).expand_as(data.private_inputs)
    class_means = class_mean_images(data.aux_inputs, data.aux_labels)[data.private_labels]
    return DigitsAuditResult(
        accuracy,
        F.mse_loss(mean_image, data.private_inputs).item(),
        F.mse_loss(class_means, data.private_inputs).item(),
        scores,
        model,
        sdar_attacks,
        data,
        pngs,
    )


def class_mean_images(inputs: Tensor, labels: Tensor, num_classes: int = NUM_CLASSES) -> Tensor:
    """Mean image per class, [num_classes, ...]: the guess a server holding the labels (vanilla
    SL) makes from its auxiliary data alone, the baseline an attack must beat to show leakage
    beyond the label. ValueError if a class has no image."""
    counts = torch.bincount(labels, minlength=num_classes)
    if (counts == 0).any():
        missing = torch.nonzero(counts == 0).flatten().tolist()
        raise ValueError(f"classes {missing} have no image to average")
    sums = torch.zeros(num_classes, *inputs.shape[1:], dtype=inputs.dtype)
    sums.index_add_(0, labels, inputs)
    return sums / counts.view(-1, *([1] * (inputs.dim() - 1))).to(inputs.dtype)


def _conditioned(module: nn.Module, shape: tuple[int, ...], conditional: bool) -> nn.Module:
    """The module, label-conditioned on inputs of `shape` when asked."""
    return LabelConditioned(module, NUM_CLASSES, shape) if conditional else module


def _adam(modules: Sequence[nn.Module], config: DigitsSplitConfig) -> torch.optim.Adam:
    """Adam for one party's modules, its weight decay the l2 defence's gradient 2 * l2 * w."""
    return torch.optim.Adam(
        [p for m in modules for p in m.parameters()],
        lr=config.learning_rate,
        weight_decay=2 * config.l2,
    )

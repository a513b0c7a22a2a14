"""Membership and property inference against uploaded models (FedMeNF, paper 004, App. C).

An honest-but-curious server renders images from each client's uploaded model and trains a
small CNN attacker (two convolutions, two fully connected layers) on shadow clients, then
scores it on held-out target clients:

- membership (Shokri et al. 2017, as FedMeNF builds it): the input is a pair (an image, the
  render of one client's upload at that image's coordinates); label 1 when the image is in
  that client's training data (paired with its owner's upload), 0 when paired with another
  client's upload. Chance is 50% on the balanced pairs. The attacker trains on every shadow
  image paired with every shadow upload (`shadow_membership_pairs`, classes weighed even):
  one outsider per image would leave 16 shadow clients of two images each 64 pairs.
- property (Ganju et al. 2018): the input is the render of a client's upload, the label a
  property of the client's data (e.g. the object's kind). Chance is the majority class.

Beside the paper's CNN, two threshold attacks on the same pairs need no network: a score
per pair, member on the side of the threshold most accurate on the shadow pairs. "mse" is
minus the pair's mean squared error (the loss-threshold attack of Yeom et al. 2018); and
"correlation" is the Pearson correlation over pixels, blind to any affine rescaling of the
render, so an upload that hides its client's images only behind an output offset and
scale does not fool it.

Accuracy near chance means the uploads tell the attacker nothing it can learn from the
shadow clients. Pure PyTorch; `simulations.bench.fedmenf_table` builds the inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.metrics import roc_auc_score
from torch import Tensor, nn


@dataclass(frozen=True)
class AttackConfig:
    """The attacker's training: Adam, full-batch epochs, seeded."""

    epochs: int = 200
    learning_rate: float = 1e-3
    hidden: int = 64
    seed: int = 0
    balance_classes: bool = False  # weigh the loss by inverse class frequency

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.hidden < 1 or not self.learning_rate > 0:
            raise ValueError(f"epochs, hidden and learning_rate must be positive: {self}")


@dataclass(frozen=True)
class AttackResult:
    """Test accuracy, ROC AUC (binary attacks; None otherwise) and the chance accuracy."""

    accuracy: float
    auc: float | None
    chance: float
    train_accuracy: float


def attacker_network(channels: int, classes: int, hidden: int = 64) -> nn.Module:
    """Two 3x3 convolutions (stride 2) and two fully connected layers, as in App. C."""
    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(32 * 16, hidden),
        nn.ReLU(),
        nn.Linear(hidden, classes),
    )


def membership_pairs(
    images: Sequence[Tensor], own_renders: Sequence[Tensor], other_renders: Sequence[Tensor]
) -> tuple[Tensor, Tensor]:
    """Balanced pairs: (image, its owner's render) labelled 1, (image, another's) 0.

    All [H, W, C] in [0, 1]; returns inputs [2N, 2C, H, W] and labels [2N].
    """
    if not len(images) == len(own_renders) == len(other_renders) > 0:
        raise ValueError(
            f"{len(images)} images, {len(own_renders)} own and {len(other_renders)} other renders"
        )
    pairs, labels = [], []
    for image, own, other in zip(images, own_renders, other_renders, strict=True):
        for render, label in ((own, 1), (other, 0)):
            if render.shape != image.shape:
                raise ValueError(f"render shape {tuple(render.shape)} != {tuple(image.shape)}")
            pairs.append(torch.cat([image, render], dim=-1).permute(2, 0, 1))
            labels.append(label)
    return torch.stack(pairs).float(), torch.tensor(labels)


def shadow_membership_pairs(
    images: Sequence[Tensor], owners: Sequence[int], renders: Sequence[Sequence[Tensor]]
) -> tuple[Tensor, Tensor]:
    """The attacker's training pairs from its shadow clients: every image with every shadow
    upload's render of it, labelled 1 with its owner's upload and 0 with each other one.

    `owners[i]` indexes the upload that image i's client sent; `renders[u][i]` is upload u's
    render at image i's coordinates; all [H, W, C] in [0, 1]. Returns inputs [N*U, 2C, H, W]
    and labels [N*U], one member per U-1 outsiders (`balance_classes` weighs them even).
    """
    if len(images) != len(owners) or not images or any(len(r) != len(images) for r in renders):
        raise ValueError(
            f"{len(images)} images, {len(owners)} owners, renders per upload "
            f"{[len(r) for r in renders]}"
        )
    if len(renders) < 2 or not all(0 <= owner < len(renders) for owner in owners):
        raise ValueError(f"owners {sorted(set(owners))} must index {len(renders)} >= 2 uploads")
    pairs, labels = [], []
    for upload, views in enumerate(renders):
        for image, owner, render in zip(images, owners, views, strict=True):
            if render.shape != image.shape:
                raise ValueError(f"render shape {tuple(render.shape)} != {tuple(image.shape)}")
            pairs.append(torch.cat([image, render], dim=-1).permute(2, 0, 1))
            labels.append(int(owner == upload))
    return torch.stack(pairs).float(), torch.tensor(labels)


def class_weights(labels: Tensor, classes: int) -> Tensor:
    """Inverse-frequency loss weights [classes] that make every present class count alike
    (all ones on balanced labels; 0 for a class absent from `labels`)."""
    counts = torch.bincount(labels, minlength=classes).double()
    present = int((counts > 0).sum())
    weights = torch.where(counts > 0, counts.sum() / (present * counts.clamp(min=1)), 0.0)
    return weights.float()


SIMILARITIES = ("mse", "correlation")


def pair_similarity(image: Tensor, render: Tensor, similarity: str) -> float:
    """Threshold attacks' score of one (image, render) pair: minus their MSE, or the
    Pearson correlation of their pixels (0 where either is constant)."""
    if render.shape != image.shape:
        raise ValueError(f"render shape {tuple(render.shape)} != {tuple(image.shape)}")
    if similarity == "mse":
        return -float((image - render).square().mean())
    if similarity == "correlation":
        x = image.flatten().double() - image.double().mean()
        y = render.flatten().double() - render.double().mean()
        norm = float(x.norm() * y.norm())
        return float(x @ y) / norm if norm > 0 else 0.0
    raise ValueError(f"similarity must be one of {SIMILARITIES}, got {similarity!r}")


def similarity_pairs(
    images: Sequence[Tensor],
    own_renders: Sequence[Tensor],
    other_renders: Sequence[Tensor],
    similarity: str,
) -> tuple[Tensor, Tensor]:
    """`membership_pairs`'s pairs as scores [2N] (same order) and labels [2N]."""
    if not len(images) == len(own_renders) == len(other_renders) > 0:
        raise ValueError(
            f"{len(images)} images, {len(own_renders)} own and {len(other_renders)} other renders"
        )
    scores, labels = [], []
    for image, own, other in zip(images, own_renders, other_renders, strict=True):
        scores += [
            pair_similarity(image, own, similarity),
            pair_similarity(image, other, similarity),
        ]
        labels += [1, 0]
    return torch.tensor(scores, dtype=torch.float64), torch.tensor(labels)


def threshold_attack(
    train_scores: Tensor, train_labels: Tensor, test_scores: Tensor, test_labels: Tensor
) -> AttackResult:
    """Member (1) on one side of the threshold most accurate on the shadow scores (midpoints
    between sorted scores), the side chosen on the shadow scores too: an upload pushed away
    from its own data (a lower score for members) is as telling as one that memorises it.
    Ties keep "at or above". AUC ranks the target scores oriented by that side."""
    if len(train_scores) != len(train_labels) or len(test_scores) != len(test_labels):
        raise ValueError("each score needs one label")
    if len(train_scores) == 0 or len(test_scores) == 0:
        raise ValueError("the threshold attack needs shadow and target scores")
    ordered = torch.sort(train_scores.double()).values
    candidates = torch.cat(
        [ordered[:1] - 1.0, (ordered[1:] + ordered[:-1]) / 2, ordered[-1:] + 1.0]
    )
    truth = train_labels.bool()
    above = train_scores.double()[None, :] >= candidates[:, None]
    correct = torch.cat([(above == truth).sum(dim=1), (~above == truth).sum(dim=1)])
    best = int(correct.argmax())
    members_above = best < len(candidates)  # else members score below the threshold
    at_or_above = test_scores.double() >= candidates[best % len(candidates)]
    predicted = at_or_above if members_above else ~at_or_above
    sign = 1.0 if members_above else -1.0
    accuracy = float((predicted == test_labels.bool()).float().mean())
    auc = None
    if len(set(test_labels.tolist())) == 2:
        auc = float(roc_auc_score(test_labels.numpy(), sign * test_scores.numpy()))
    counts = np.bincount(test_labels.numpy(), minlength=2)
    return AttackResult(
        accuracy, auc, float(counts.max() / counts.sum()), float(correct.max()) / len(truth)
    )


def attack_folds(clients: Sequence[int], folds: int) -> list[tuple[list[int], list[int]]]:
    """(shadow, target) splits in which every client is a target exactly once: `clients` cut
    into `folds` contiguous parts of near-equal size, each the targets of one split."""
    if not 2 <= folds <= len(clients):
        raise ValueError(f"need 2 <= folds <= {len(clients)} clients, got {folds}")
    bounds = [round(i * len(clients) / folds) for i in range(folds + 1)]
    parts = [list(clients[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    return [([c for other in parts if other is not part for c in other], part) for part in parts]


def pooled(results: Sequence[AttackResult], sizes: Sequence[int]) -> AttackResult:
    """One figure for attacks scored on disjoint target sets of `sizes`: accuracy and chance
    over all targets together, AUC and shadow accuracy averaged over the attacks."""
    if not results or len(results) != len(sizes):
        raise ValueError(f"{len(results)} results for {len(sizes)} target sets")
    total = sum(sizes)
    aucs = [r.auc for r in results if r.auc is not None]
    return AttackResult(
        accuracy=sum(r.accuracy * n for r, n in zip(results, sizes, strict=True)) / total,
        auc=float(np.mean(aucs)) if aucs else None,
        chance=sum(r.chance * n for r, n in zip(results, sizes, strict=True)) / total,
        train_accuracy=float(np.mean([r.train_accuracy for r in results])),
    )


def train_attack(
    train_inputs: Tensor,
    train_labels: Tensor,
    test_inputs: Tensor,
    test_labels: Tensor,
    config: AttackConfig = AttackConfig(),
) -> AttackResult:
    """Fit the attacker on the shadow inputs [N, C, H, W] and labels [N] (0..K-1); score it
    on the targets."""
    if train_inputs.shape[1:] != test_inputs.shape[1:]:
        raise ValueError(f"input shapes differ: {train_inputs.shape} vs {test_inputs.shape}")
    if len(train_inputs) != len(train_labels) or len(test_inputs) != len(test_labels):
        raise ValueError("each input needs one label")
    classes = int(max(train_labels.max(), test_labels.max())) + 1
    weights = class_weights(train_labels, max(classes, 2)) if config.balance_classes else None
    with torch.random.fork_rng():
        torch.manual_seed(config.seed)
        network = attacker_network(train_inputs.shape[1], max(classes, 2), config.hidden)
        optimiser = torch.optim.Adam(network.parameters(), lr=config.learning_rate)
        for _ in range(config.epochs):
            optimiser.zero_grad()
            loss = nn.functional.cross_entropy(network(train_inputs), train_labels, weight=weights)
            loss.backward()
            optimiser.step()
    network.eval()
    with torch.no_grad():
        train_accuracy = float((network(train_inputs).argmax(1) == train_labels).float().mean())
        logits = network(test_inputs)
    accuracy = float((logits.argmax(1) == test_labels).float().mean())
    auc = None
    if classes <= 2 and len(set(test_labels.tolist())) == 2:
        scores = torch.softmax(logits, 1)[:, 1].numpy()
        auc = float(roc_auc_score(test_labels.numpy(), scores))
    counts = np.bincount(test_labels.numpy(), minlength=classes)
    return AttackResult(accuracy, auc, float(counts.max() / counts.sum()), train_accuracy)

"""Audit of a federated meta-learning run (FedMeNF and the MAML/FOMAML/Reptile baselines).

The run directory holds the final meta-learner theta (checkpoint.pt), so the audit measures
what theta gives and what it leaks, with the tasks the run-config names:

- utility: test-time optimisation (TTO) from theta on the public held-out tasks, PSNR/SSIM of
  the query set after the task's preset steps, as the meta job's own evaluation does;
- leakage: PSNR_p of theta on every client's private query sets (FedMeNF Eq. 6, rendered
  with no optimisation), SSIM_p, LPIPS_p, and PSNR_p after the blind and the oracle affine
  rescaling of its outputs (`rescaled_privacy_psnr`);
- membership inference against theta (`fedfields.privacy.attacks.inference`): an attacker
  gets (image, theta's render of it) pairs, label 1 when the image is in a client's query
  set (trained on), 0 when it is a held-out task's (never seen); half of each trains it,
  the other half scores it. Chance is 50%.

The run's observer measured the same on each client's uploads w_i (which the run directory
does not keep); summary.json's figures are reported as recorded during the run.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from fedfields import atomic
from fedfields.audit.pipeline import (
    CHECKPOINT_FILE,
    AuditConfig,
    AuditResult,
    RunInfo,
    progress_bar,
)
from fedfields.config import meta_settings
from fedfields.devices import resolve_device
from fedfields.privacy.accountant import EPSILON_METRIC
from fedfields.privacy.attacks.inference import AttackConfig, train_attack
from fedfields.train.builders import (
    as_image_batch,
    client_meta_tasks,
    client_object_folder,
    heldout_meta_tasks,
    mean_quality,
    meta_model,
    tto_qualities,
    tto_schedule,
)
from fedfields.train.checkpoint import META_CHECKPOINT_FORMAT
from fedfields.train.meta import privacy_metrics, rescaled_privacy_psnr
from fedfields.train.meta_tasks import MetaTask

RECORDED = (
    "psnr_p",
    "ssim_p",
    "lpips_p",
    "psnr_p_rescaled",
    "psnr_p_oracle",
    "mia-accuracy",
    "mia-auc",
    "pia-accuracy",
    EPSILON_METRIC,
)
"""summary.json's final figures of the clients' uploads (and a DP run's epsilon) that the
audit repeats as recorded."""


def load_theta(path: Path) -> dict[str, Tensor]:
    """theta's parameters from a meta run's checkpoint.pt; ValueError for anything else."""
    payload = atomic.load_torch(path, "meta-learning checkpoint")
    if not isinstance(payload, dict) or payload.get("format") != META_CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a meta-learning checkpoint (missing format tag)")
    return payload["state_dict"]


def query_images(task: MetaTask, values: Tensor) -> list[Tensor]:
    """Query-shaped values as a list of [H, W, C] images in [0, 1]."""
    return list(as_image_batch(task.query_images(values.clamp(0.0, 1.0))))


def membership_samples(
    model: nn.Module, theta: dict[str, Tensor], tasks: Sequence[MetaTask]
) -> list[Tensor]:
    """(image, theta's render of it) pairs as [2C, H, W] inputs, one per query image."""
    samples = []
    for task in tasks:
        with torch.no_grad():
            renders = query_images(task, task.render_query(model, theta))
        truths = query_images(task, task.query_targets)
        samples += [
            torch.cat([image, render], dim=-1).permute(2, 0, 1).float()
            for image, render in zip(truths, renders, strict=True)
        ]
    return samples


def membership_split(
    members: list[Tensor], outsiders: list[Tensor], seed: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Balanced shadow (train) and target (test) sets: as many members as outsiders, each
    shuffled and halved; labels 1 for members, 0 for outsiders."""
    rng = random.Random(seed)
    count = min(len(members), len(outsiders))
    chosen = [rng.sample(group, count) for group in (members, outsiders)]
    half = count // 2
    train = chosen[0][:half] + chosen[1][:half]
    test = chosen[0][half:] + chosen[1][half:]
    rest = count - half
    return (
        torch.stack(train),
        torch.tensor([1] * half + [0] * half),
        torch.stack(test),
        torch.tensor([1] * rest + [0] * rest),
    )


def theta_membership(
    model: nn.Module,
    theta: dict[str, Tensor],
    client_tasks: Sequence[MetaTask],
    heldout: Sequence[MetaTask],
    seed: int,
) -> tuple[dict[str, float], str | None]:
    """Membership inference against theta: (scores, None), or ({}, why it was skipped)."""
    members = membership_samples(model, theta, client_tasks)
    outsiders = membership_samples(model, theta, heldout)
    if min(len(members), len(outsiders)) < 2:
        return {}, "needs at least 2 client query images and 2 held-out ones"
    shapes = {tuple(sample.shape) for sample in members + outsiders}
    if len(shapes) > 1:
        return {}, f"query images differ in shape ({sorted(shapes)}): no common attacker input"
    inputs = membership_split(members, outsiders, seed)
    result = train_attack(*inputs, AttackConfig(seed=seed))
    scores = {"theta-mia-accuracy": result.accuracy, "theta-mia-chance": result.chance}
    if result.auc is not None:
        scores["theta-mia-auc"] = result.auc
    return scores, None


def audit_meta(run: RunInfo, settings: AuditConfig) -> AuditResult:
    """Utility (TTO) and leakage (PSNR_p, membership) of the run's theta (module docstring)."""
    config = run.config
    meta = meta_settings(config)
    model = meta_model(config, meta).to(resolve_device(settings.device))
    theta = load_theta(run.run_dir / CHECKPOINT_FILE)
    heldout = heldout_meta_tasks(config, meta)
    clients = range(min(meta.num_clients, settings.max_clients or meta.num_clients))
    client_tasks: list[MetaTask] = []
    for client in progress_bar(list(clients), "meta audit: clients' tasks", settings):
        folder = None
        if config.common.task == "objects":
            folder = client_object_folder(config.deployment.data_dir, client)
        client_tasks += client_meta_tasks(config, meta, client, folder)
    leakage = mean_quality(
        [
            privacy_metrics(model, theta, task) | rescaled_privacy_psnr(model, theta, task)
            for task in progress_bar(client_tasks, "meta audit: PSNR_p of theta", settings)
        ]
    )
    utility: dict[str, float | None] = {}
    skipped: dict[str, str] = {}
    if heldout:
        last = tto_schedule(meta.tto_steps)[-1]
        curves = [
            tto_qualities(model, theta, task, config, meta)
            for task in progress_bar(heldout, "meta audit: TTO on held-out tasks", settings)
        ]
        after = mean_quality([curve[last] for curve in curves])
        before = mean_quality([curve[0] for curve in curves])
        utility = {"tto-psnr": after["psnr"], "tto-ssim": after["ssim"]}
        utility |= {"tto-steps": float(last), "psnr-before-tto": before["psnr"]}
        membership, why = theta_membership(model, theta, client_tasks, heldout, settings.seed)
        leakage |= membership
        if why:
            skipped["membership inference"] = why
    else:
        reason = "no public held-out tasks (run-config 'eval-scene-dir' is empty)"
        skipped |= {"test-time optimisation": reason, "membership inference": reason}
    final = run.summary().get("final", {})
    return AuditResult(
        run_dir=run.run_dir,
        pipeline="meta",
        label=f"{config.meta.meta_learner}/{config.strategy_name}/{config.common.task}",
        headline=("tto-psnr", "psnr_p", None),
        utility=utility,
        leakage=leakage,
        recorded={k: float(final[k]) for k in RECORDED if isinstance(final.get(k), int | float)},
        skipped=skipped,
        settings={
            "task": config.common.task,
            "clients": len(clients),
            "client-tasks": len(client_tasks),
            "heldout-tasks": len(heldout),
            "tto-steps": meta.tto_steps,
            "tto-lr": meta.tto_lr,
            "model": "checkpoint.pt: the final meta-learner theta",
        },
    )

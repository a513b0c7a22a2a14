"""Audit of a split-learning run (SplitNeRF, run-config mode "split").

Utility: held-out PSNR/SSIM of the client's joint field (server part + client head), from
the copy of the client's checkpoint.pt the simulation's split audit keeps in the run
directory, on the held-out views of the client's scene (run-config `data-dir`).

Leakage, from what the honest-but-curious server saw on the wire (transcript.pt, written by
the simulation with run-config `split-attack`) and its own final part:

- the Surrogate Model Attack offline (paper 000, Algorithm 1, `surrogate_model_attack`) and
  online (`online_surrogate_attack`, the paper's schedule, `paper_online_config`);
- SDAR on the split NeRF (`sdar_nerf_attack`, paper 001 transferred) with an auxiliary
  procedural object the server owns, and its naive simulator baseline (no discriminator);

each a client head the server reconstructs, rendered with the server part at the client's
held-out cameras as depth and grey views and scored by SSIM against the client's true joint
field (`score_attack`); the reference is an untrained surrogate head. A run without a
transcript skips every attack and says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from functools import cache
from typing import Any

import torch

from fedfields.audit.pipeline import (
    CHECKPOINT_FILE,
    AuditConfig,
    AuditResult,
    RunInfo,
    progress_bar,
)
from fedfields.data import Scene
from fedfields.privacy import ClientPart, ServerPart, SplitExchange, split_field
from fedfields.privacy.attacks import (
    SDARNeRFConfig,
    SurrogateAttackConfig,
    make_surrogate_head,
    procedural_scene,
    score_attack,
    sdar_nerf_attack,
    surrogate_model_attack,
)
from fedfields.privacy.attacks.surrogate import online_surrogate_attack, paper_online_config
from fedfields.privacy.split import TRANSCRIPT_FILE, load_transcript
from fedfields.render import RenderConfig
from fedfields.train.builders import client_views, split_scene_dir
from fedfields.train.checkpoint import load_checkpoint
from fedfields.train.evaluation import evaluate

ATTACKS = ("surrogate-offline", "surrogate-online", "sdar", "sdar-naive")
SCORES = ("ssim_depth", "ssim_grey")  # of the attacked renders against the client's
Attack = Callable[[], ClientPart]


def auxiliary_scene(
    transcript: list[SplitExchange],
    render_config: RenderConfig,
    heldout: Scene,
    settings: AuditConfig,
) -> Scene:
    """SDAR's auxiliary data: the server's own procedural object, seen from the distance of
    the client's (public) ray origins, at the client's image size."""
    origins = torch.cat([exchange.samples.origins for exchange in transcript])
    return procedural_scene(
        render_config,
        origins.norm(dim=-1).mean().item(),
        settings.sdar_aux,
        resolution=max(heldout.cameras.width, heldout.cameras.height),
        seed=settings.seed,
    )


def attacks(
    server: ServerPart,
    transcript: list[SplitExchange],
    background: torch.Tensor,
    aux: Callable[[], Scene],
    render_config: RenderConfig,
    seed: int,
) -> dict[str, Attack]:
    """Each attack of `ATTACKS` as a call returning the client head it reconstructs."""
    sdar = SDARNeRFConfig(seed=seed)
    naive = SDARNeRFConfig.naive(seed=seed)
    return {
        "surrogate-offline": lambda: (
            surrogate_model_attack(
                server, transcript, background, SurrogateAttackConfig(seed=seed)
            ).head
        ),
        "surrogate-online": lambda: (
            online_surrogate_attack(server, transcript, background, paper_online_config(seed)).head
        ),
        "sdar": lambda: sdar_nerf_attack(server, transcript, aux(), render_config, sdar).head,
        "sdar-naive": lambda: (
            sdar_nerf_attack(server, transcript, aux(), render_config, naive).head
        ),
    }


def attack_settings(seed: int, sdar_aux: str) -> dict[str, Any]:
    """The attacks' configurations, for audit.json."""
    return {
        "surrogate-offline": asdict(SurrogateAttackConfig(seed=seed)),
        "surrogate-online": asdict(paper_online_config(seed)),
        "sdar": asdict(SDARNeRFConfig(seed=seed)) | {"aux": sdar_aux},
        "sdar-naive": asdict(SDARNeRFConfig.naive(seed=seed)) | {"aux": sdar_aux},
    }


def audit_split(run: RunInfo, settings: AuditConfig) -> AuditResult:
    """Utility of the client's joint field, leakage of the server's attacks (module docstring)."""
    config = run.config
    _, heldout = client_views(
        str(split_scene_dir(config.deployment.data_dir)), config.common.downscale
    )
    truth, render_config, _, _ = load_checkpoint(run.run_dir / CHECKPOINT_FILE)
    evaluation = evaluate(truth, heldout, render_config, progress=settings.progress)
    server, client = split_field(truth)  # type: ignore[arg-type]
    server.eval()
    views = list(range(len(heldout)))
    untrained = make_surrogate_head(server.embedding_dim, SurrogateAttackConfig(seed=settings.seed))
    with torch.no_grad():
        baseline = score_attack(server, untrained, client, heldout.cameras, views, render_config)
    leakage: dict[str, float | None] = {}
    skipped: dict[str, str] = {}
    path = run.run_dir / TRANSCRIPT_FILE
    transcript = load_transcript(path) if path.is_file() else []
    if transcript:
        background = torch.tensor(heldout.background, dtype=torch.float32)

        @cache
        def aux() -> Scene:
            return auxiliary_scene(transcript, render_config, heldout, settings)

        found = attacks(server, transcript, background, aux, render_config, settings.seed)
        for name in progress_bar(list(found), "split audit: attacks", settings):
            head = found[name]()
            with torch.no_grad():
                scores = score_attack(server, head, client, heldout.cameras, views, render_config)
            leakage |= {f"{name}-{key}": scores[key] for key in SCORES}
    else:
        why = (
            f"no exchanges in {TRANSCRIPT_FILE}: the run recorded none"
            if path.is_file()
            else f"no {TRANSCRIPT_FILE} in the run directory: the run was made without "
            "run-config 'split-attack', so the exchanges the server saw were not recorded"
        )
        skipped = {name: why for name in ATTACKS}
    attack = run.summary().get("attack", {})
    recorded = {
        f"surrogate-{key}": float(attack["attacked"][key])
        for key in SCORES
        if isinstance(attack.get("attacked", {}).get(key), int | float)
    }
    return AuditResult(
        run_dir=run.run_dir,
        pipeline="split",
        label="split",
        headline=("heldout-psnr", "surrogate-offline-ssim_depth", "untrained-ssim_depth"),
        utility={"heldout-psnr": evaluation.psnr, "heldout-ssim": evaluation.ssim},
        leakage=leakage,
        reference={f"untrained-{key}": baseline[key] for key in SCORES},
        recorded=recorded,
        skipped=skipped,
        settings={
            "heldout-views": len(heldout),
            "transcript-steps": len(transcript),
            "attacks": attack_settings(settings.seed, settings.sdar_aux) if transcript else {},
            "truth": "checkpoint.pt: the client's joint field, copied by the split audit",
        },
    )

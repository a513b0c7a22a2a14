"""Audit of a federated scene run (DecentNeRF, FedNeRF and the FedAvg family on a crowd).

Utility: clean-view PSNR/SSIM of the checkpoint's global field, the aggregate the server
holds, on every user's views without persons (and on the crowd's held-out views, if any).
Leakage: PSNR inside each user's personal-content masks against the user's photo, rendered
from that same field (what the server reads), next to its floor, the clean view scored the
same way (a field that renders no person; `fedfields.privacy.leakage`). What the run's
observer measured round by round (e.g. each user's plaintext upload inside its masks) is
reported as recorded during the run: the checkpoint holds the aggregate only.
"""

from __future__ import annotations

from fedfields.audit.pipeline import (
    CHECKPOINT_FILE,
    AuditConfig,
    AuditResult,
    RunInfo,
    counted,
    last_values,
)
from fedfields.data.crowd import CrowdData
from fedfields.privacy.accountant import EPSILON_METRIC
from fedfields.privacy.leakage import PERSONAL_FLOOR, UPLOAD_LEAK, score_crowd
from fedfields.train.evaluation import FieldRenderer

RECORDED = (UPLOAD_LEAK, EPSILON_METRIC)
"""The last-round figures the checkpoint cannot give: each user's plaintext upload inside its
masks (the checkpoint holds the aggregate only) and, for a DP run, the epsilon it spent."""


def scored_views(data: CrowdData, max_views: int | None) -> list[int] | None:
    """The views scored per user: all (None), or the first `max_views` every user has."""
    if max_views is None:
        return None
    return list(range(min([max_views, *(len(user.scene) for user in data.users)])))


def audit_scene(run: RunInfo, settings: AuditConfig) -> AuditResult:
    """Utility and personal-content leakage of the run's global field (module docstring)."""
    config = run.config
    data = CrowdData.load(config.deployment.data_dir, config.common.downscale)
    path = run.run_dir / CHECKPOINT_FILE
    renderer = FieldRenderer.from_checkpoint(config, path, settings.device)
    views = scored_views(data, settings.max_views)
    total = sum(len(views) if views is not None else len(u.scene) for u in data.users)
    render = counted(renderer, total, "scene audit: render users' views", settings)
    scores = score_crowd(render, data.users, views, perceptual=True)
    utility: dict[str, float | None] = {
        key: scores[key] for key in ("clean-psnr", "clean-ssim", "clean-lpips") if key in scores
    }
    if data.heldout is not None:
        heldout = data.heldout
        heldout_scores = renderer.score_scene(heldout, range(len(heldout)), perceptual=True)
        utility |= {f"heldout-{name}": value for name, value in heldout_scores.items()}
    return AuditResult(
        run_dir=run.run_dir,
        pipeline="scene",
        label=config.strategy_name,
        headline=("clean-psnr", "personal-psnr", PERSONAL_FLOOR),
        utility=utility,
        leakage={"personal-psnr": scores["personal-psnr"]},
        reference={PERSONAL_FLOOR: scores[PERSONAL_FLOOR]},
        recorded=last_values(run.metric_lines(), RECORDED),
        settings={
            "users": len(data.users),
            "views-per-user": "all" if views is None else len(views),
            "field": "checkpoint.pt: the server's aggregated global field",
            "data-dir": config.deployment.data_dir,
        },
    )

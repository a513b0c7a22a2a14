"""Checkpoints that carry everything needed to rebuild and render a field."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from fedfields import atomic
from fedfields.fields import Field, build_field
from fedfields.render import OccupancyGrid, RenderConfig

META_CHECKPOINT_FORMAT = "fedfields-meta-checkpoint-1"  # theta of a meta run (meta job)


def save_checkpoint(
    path: str | Path,
    field: Field,
    render_config: RenderConfig,
    occupancy: OccupancyGrid | None,
    metadata: dict[str, Any] | None = None,
) -> None:
    """Write field configuration and weights, render settings and occupancy grid to `path`.

    Written atomically (`fedfields.atomic`), so a crash never leaves half a checkpoint.
    """
    path = Path(path)
    payload = {
        "format": "fedfields-checkpoint-1",
        "field": field.config_dict(),
        "state_dict": field.state_dict(),
        "render": asdict(render_config),
        "occupancy": occupancy.state_dict() if occupancy is not None else None,
        "metadata": metadata or {},
    }
    atomic.save_torch(path, payload)


def load_checkpoint(
    path: str | Path,
) -> tuple[Field, RenderConfig, OccupancyGrid | None, dict[str, Any]]:
    """Rebuild (field, render config, occupancy grid, metadata) from a checkpoint file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    payload = atomic.load_torch(path, "fedfields checkpoint")
    if not isinstance(payload, dict) or payload.get("format") != "fedfields-checkpoint-1":
        raise ValueError(f"{path} is not a fedfields checkpoint (missing format tag)")
    try:
        field = build_field(payload["field"])
        field.load_state_dict(payload["state_dict"])
    except (KeyError, TypeError, RuntimeError) as error:
        kind = type(error).__name__
        raise ValueError(f"{path} holds a damaged field ({kind}: {error})"[:300]) from None
    field.eval()
    render = payload["render"]
    render_config = RenderConfig(
        **{**render, "aabb": tuple(render["aabb"]), "background": tuple(render["background"])}
    )
    occupancy = None
    if payload["occupancy"] is not None:
        occupancy = OccupancyGrid(render_config.aabb_tensor)
        occupancy.load_state_dict(payload["occupancy"])
    return field, render_config, occupancy, payload["metadata"]

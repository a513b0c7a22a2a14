"""Neural fields behind one interface: NeRF MLP, Instant-NGP hash grid, SIREN."""

from __future__ import annotations

from typing import Any

from fedfields.fields.base import Field, FieldOutputs
from fedfields.fields.encodings import HashGridConfig, HashGridEncoding, tcnn_available
from fedfields.fields.hashgrid import HashGridField, HashGridFieldConfig
from fedfields.fields.nerf import NeRFField, NeRFFieldConfig
from fedfields.fields.siren import Siren, SirenConfig, SirenField


def build_field(config: dict[str, Any]) -> Field:
    """Rebuild a field from `Field.config_dict()` output (as stored in checkpoints)."""
    options = dict(config)
    kind = options.pop("kind", None)
    if kind == "hashgrid":
        encoding = HashGridConfig(**options.pop("encoding", {}))
        options["aabb"] = tuple(options.get("aabb", HashGridFieldConfig.aabb))
        return HashGridField(HashGridFieldConfig(encoding=encoding, **options))
    if kind == "nerf":
        options["skips"] = tuple(options.get("skips", ()))
        return NeRFField(NeRFFieldConfig(**options))
    if kind == "siren":
        return SirenField(SirenConfig(**options))
    raise ValueError(f"unknown field kind {kind!r}; expected 'hashgrid', 'nerf' or 'siren'")


__all__ = [
    "Field",
    "FieldOutputs",
    "HashGridConfig",
    "HashGridEncoding",
    "HashGridField",
    "HashGridFieldConfig",
    "NeRFField",
    "NeRFFieldConfig",
    "Siren",
    "SirenConfig",
    "SirenField",
    "build_field",
    "tcnn_available",
]

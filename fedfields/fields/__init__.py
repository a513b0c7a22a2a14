"""Neural fields behind one interface: NeRF MLP, Instant-NGP hash grid, SIREN, personal fields."""

from __future__ import annotations

from typing import Any

from fedfields.fields.base import Field, FieldOutputs
from fedfields.fields.encodings import HashGridConfig, HashGridEncoding, tcnn_available
from fedfields.fields.hashgrid import HashGridField, HashGridFieldConfig
from fedfields.fields.nerf import NeRFField, NeRFFieldConfig
from fedfields.fields.personal import GlobalPersonalField, PersonalField, PersonalFieldConfig
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
    if kind == "personal":
        encoding = HashGridConfig(**options.pop("encoding", {}))
        options["aabb"] = tuple(options.get("aabb", PersonalFieldConfig.aabb))
        return PersonalField(PersonalFieldConfig(encoding=encoding, **options))
    if kind == "global_personal":
        personal = build_field(options["personal_field"])
        if not isinstance(personal, PersonalField):
            raise ValueError("a global_personal field's personal_field must be of kind 'personal'")
        return GlobalPersonalField(build_field(options["global_field"]), personal)
    raise ValueError(
        f"unknown field kind {kind!r}; expected 'hashgrid', 'nerf', 'siren', 'personal' "
        "or 'global_personal'"
    )


__all__ = [
    "Field",
    "FieldOutputs",
    "GlobalPersonalField",
    "HashGridConfig",
    "HashGridEncoding",
    "HashGridField",
    "HashGridFieldConfig",
    "NeRFField",
    "NeRFFieldConfig",
    "PersonalField",
    "PersonalFieldConfig",
    "Siren",
    "SirenConfig",
    "SirenField",
    "build_field",
    "tcnn_available",
]

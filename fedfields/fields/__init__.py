"""Neural fields behind one interface: NeRF MLP, Instant-NGP hash grid, SIREN, personal fields,
3D Gaussian splats."""

from __future__ import annotations

from fedfields.fields.base import FIELD_KINDS, Field, FieldOutputs, build_field
from fedfields.fields.encodings import HashGridConfig, HashGridEncoding, tcnn_available
from fedfields.fields.hashgrid import HashGridField, HashGridFieldConfig
from fedfields.fields.nerf import NeRFField, NeRFFieldConfig
from fedfields.fields.personal import GlobalPersonalField, PersonalField, PersonalFieldConfig
from fedfields.fields.siren import Siren, SirenConfig, SirenField
from fedfields.fields.splats import SplatAppearance, SplatField, SplatFieldConfig

__all__ = [
    "FIELD_KINDS",
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
    "SplatAppearance",
    "SplatField",
    "SplatFieldConfig",
    "build_field",
    "tcnn_available",
]

"""The run-config: one validated dataclass per section (`schema`), FedMeNF's per-task presets
(`presets`) and the generated reference docs/RUN_CONFIG.md (`reference`)."""

from __future__ import annotations

from fedfields.config.presets import META_PRESETS, MetaSettings, meta_round_sizes, meta_settings
from fedfields.config.schema import (
    SECTIONS,
    CommonSection,
    DeploymentSection,
    FederatedConfig,
    MetaSection,
    SceneSection,
    SecureSection,
    SplitSection,
    without_ignored_keys,
)

__all__ = [
    "META_PRESETS",
    "SECTIONS",
    "CommonSection",
    "DeploymentSection",
    "FederatedConfig",
    "MetaSection",
    "MetaSettings",
    "SceneSection",
    "SecureSection",
    "SplitSection",
    "meta_round_sizes",
    "meta_settings",
    "without_ignored_keys",
]

"""The run-config by sections: validation messages, mode checks, and the generated reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedfields.config import FederatedConfig, meta_settings
from fedfields.config.reference import reference

DOCS = Path(__file__).resolve().parents[1] / "docs" / "RUN_CONFIG.md"


def test_the_reference_in_docs_is_current() -> None:
    assert DOCS.read_text() == reference(), (
        "docs/RUN_CONFIG.md is stale: run python -m fedfields.config.reference docs/RUN_CONFIG.md"
    )


def test_every_key_is_in_the_reference_once() -> None:
    text = reference()
    for key in FederatedConfig().to_run_config():
        assert text.count(f"| `{key}` |") == 1, key


def test_keys_land_in_their_sections() -> None:
    config = FederatedConfig.from_run_config(
        {"local-steps": 7, "secure-aggregation": True, "round-timeout": 30.0, "seed": 3}
    )
    assert config.scene.local_steps == 7
    assert config.secure.secure_aggregation_config() is not None
    assert config.deployment.round_timeout == 30.0 and config.common.seed == 3
    assert FederatedConfig.from_run_config(config.to_run_config()) == config


def test_an_unknown_key_is_refused_with_the_closest_one() -> None:
    with pytest.raises(
        ValueError, match="unknown run-config key 'local-stepz'; did you mean 'local-steps'"
    ):
        FederatedConfig.from_run_config({"local-stepz": 3})


@pytest.mark.parametrize(
    ("run_config", "message"),
    [
        (
            {"split-steps": 5},
            "'split-steps' belongs to the split section, used by mode='split'; "
            "this run is task='scene' mode='federated'",
        ),
        (
            {"task": "faces", "local-steps": 3},
            "'local-steps' belongs to the scene section, used "
            "by task='scene'; this run is task='faces'",
        ),
        (
            {"meta-learner": "maml"},
            "'meta-learner' belongs to the meta section, used by "
            "task='faces' \\| 'video' \\| 'objects'; this run is task='scene'",
        ),
    ],
)
def test_a_key_of_another_mode_names_that_mode(run_config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FederatedConfig.from_run_config(run_config)


def test_keys_of_the_run_and_shared_keys_are_accepted_in_every_mode() -> None:
    faces = FederatedConfig.from_run_config({"task": "faces", "proximal-mu": 0.5, "outer-lr": 0.02})
    assert faces.common.proximal_mu == 0.5 and meta_settings(faces).outer_lr == 0.02
    split = FederatedConfig.from_run_config({"mode": "split", "split-steps": 5, "proximal-mu": 0.5})
    assert split.split.split_steps == 5 and split.common.proximal_mu == 0.5
    # the same key at its default never counts as "used", whatever the mode
    assert (
        FederatedConfig.from_run_config({"task": "video", "local-steps": 32}).common.task == "video"
    )


@pytest.mark.parametrize(
    ("run_config", "message"),
    [
        ({"local-steps": 0}, "'local-steps' must be >= 1, got 0"),
        ({"fraction-train": 1.5}, "'fraction-train' must be in \\(0, 1\\], got 1.5"),
        (
            {"hash-backend": "cuda"},
            "'hash-backend' must be one of \\('torch', 'tcnn'\\), got 'cuda'",
        ),
        ({"seed": "one"}, "'seed' must be int, got 'one'"),
        ({"task": "faces", "gamma": 2.0}, "'gamma' must be in \\[0, 1\\], got 2.0"),
        ({"secagg-timeout": -1.0}, "run-config: .*timeout"),
        ({"task": "faces", "strategy": "decentnerf"}, "'decentnerf' is for task 'scene' only"),
    ],
)
def test_a_bad_value_names_its_key_and_value(run_config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FederatedConfig.from_run_config(run_config)

"""The run-config by sections: validation messages, mode checks, and the generated reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedfields.config import META_PRESETS, FederatedConfig, MetaSettings, meta_settings
from fedfields.config.reference import reference
from fedfields.config.schema import META_TASKS, MetaSection

DOCS = Path(__file__).resolve().parents[1] / "docs" / "RUN_CONFIG.md"


def test_the_reference_in_docs_is_current() -> None:
    assert DOCS.read_text() == reference(), (
        "docs/RUN_CONFIG.md is stale: run python -m fedfields.config.reference docs/RUN_CONFIG.md"
    )


def test_the_documented_presets_are_the_presets() -> None:
    """Each meta key's "(a, b, c, d)" lists the presets of META_TASKS in order."""
    preset_keys = set(MetaSettings.__dataclass_fields__)
    documented = 0
    for name, spec in MetaSection.__dataclass_fields__.items():
        if name not in preset_keys:
            continue
        doc = spec.metadata["doc"]
        documented += 1
        listed = [part.split()[-1] for part in doc[doc.rindex("(") + 1 : -1].split(", ")]
        presets = [getattr(META_PRESETS[task], name) for task in META_TASKS]
        assert len(listed) == len(META_TASKS), (name, doc)
        assert [type(p)(v) for p, v in zip(presets, listed, strict=True)] == presets, name
    assert documented == 8  # N, E, K, lambda_i, lambda_o, outer optimiser, TTO steps and rate


def test_every_key_is_in_the_reference_once() -> None:
    text = reference()
    for key in FederatedConfig().to_run_config():
        assert text.count(f"| `{key}` |") == 1, key


def test_keys_land_in_their_sections() -> None:
    config = FederatedConfig.from_run_config(
        {
            "local-steps": 7,
            "secure-aggregation": True,
            "min-train-nodes": 3,
            "round-timeout": 30.0,
            "seed": 3,
            "aggregation-rule": "mean",
            "max-update-norm": 10.0,
        }
    )
    assert config.scene.local_steps == 7
    assert config.secure.secure_aggregation_config() is not None
    assert config.deployment.round_timeout == 30.0 and config.common.seed == 3
    assert config.robust.max_update_norm == 10.0 and config.robust.aggregation_rule == "mean"
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
            "task='faces' \\| 'photos' \\| 'video' \\| 'objects'; this run is task='scene'",
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


# ------------------------------------------------------------------ issue 18, item 4


@pytest.mark.parametrize(
    ("run_config", "message"),
    [
        ({"eval-views-per-round": 0}, r"'eval-views-per-round' must be >= 1, got 0"),
        ({"eval-views-per-round": -2}, r"'eval-views-per-round' must be >= 1, got -2"),
        (
            {"secure-aggregation": True},
            r"'secure-aggregation' = true needs at least 3 clients per round .* "
            r"'min-train-nodes' = 2 lets a round have 2: set min-train-nodes >= 3",
        ),
        (
            {"secure-aggregation": True, "min-train-nodes": 1},
            r"'min-train-nodes' = 1 lets a round have 1",
        ),
        (
            {"task": "faces", "secure-aggregation": True, "clients-per-round": 2},
            r"needs at least 3 clients per round .* 'clients-per-round' = 2",
        ),
        (
            {"min-train-nodes": 5, "min-available-nodes": 3},
            r"'min-train-nodes' = 5 is above the 3 nodes of this federation "
            r"\('min-available-nodes' = 3\)",
        ),
        (
            {"task": "video", "clients-per-round": 4, "min-available-nodes": 3},
            r"'clients-per-round' = 4 is above the 3 nodes",
        ),
        (
            {"task": "faces", "num-clients": 3, "clients-per-round": 5},
            r"'clients-per-round' = 5 is above 'num-clients' = 3",
        ),
        ({"aggregation-rule": "mode"}, r"'aggregation-rule' must be one of .*, got 'mode'"),
        ({"trim-fraction": 0.5}, r"'trim-fraction' must be in \[0, 0.5\), got 0.5"),
        ({"trim-fraction": -0.1}, r"'trim-fraction' must be in \[0, 0.5\), got -0.1"),
        ({"max-update-norm": -1.0}, r"'max-update-norm' must be finite and >= 0, got -1.0"),
        ({"max-num-examples": float("inf")}, r"'max-num-examples' must be finite and >= 0"),
        ({"alpha-max": 0.0}, r"'alpha-max' must be finite and > 0, got 0.0"),
        (
            {"aggregation-rule": "median"},
            r"'aggregation-rule' 'median' is for strategies .*; strategy 'decentnerf'",
        ),
        (
            {"strategy": "scaffold", "aggregation-rule": "trimmed-mean"},
            r"'aggregation-rule' 'trimmed-mean' is for .*; strategy 'scaffold'",
        ),
        (
            {
                "strategy": "fedavg",
                "aggregation-rule": "median",
                "secure-aggregation": True,
                "min-train-nodes": 3,
            },
            r"'aggregation-rule' 'median' needs each client's state, which "
            r"'secure-aggregation' = true hides",
        ),
    ],
)
def test_a_contradictory_value_gets_one_clear_error(run_config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FederatedConfig.from_run_config(run_config)


@pytest.mark.parametrize(
    "run_config",
    [
        {"secure-aggregation": True, "min-train-nodes": 3},
        {"task": "faces", "secure-aggregation": True, "clients-per-round": 3},
        {"strategy": "fedprox", "aggregation-rule": "trimmed-mean", "trim-fraction": 0.49},
        {"task": "faces", "aggregation-rule": "median"},
        {"min-train-nodes": 3, "min-available-nodes": 3, "max-update-norm": 0.0},
        {"mode": "split", "min-available-nodes": 1},  # split mode runs one node
    ],
)
def test_consistent_values_pass(run_config: dict) -> None:
    FederatedConfig.from_run_config(run_config)


def test_the_launchers_node_count_is_checked_before_anything_runs(tmp_path: Path) -> None:
    from simulations import launch
    from simulations.run import run_with_ray

    config = FederatedConfig.from_run_config({"min-train-nodes": 4})
    config.check_node_count(4, "num-supernodes")
    with pytest.raises(ValueError, match=r"'min-train-nodes' = 4 is above the 3 nodes .*"):
        config.check_node_count(3, "num-supernodes")
    with pytest.raises(ValueError, match=r"'min-train-nodes' = 4 is above the 2 nodes"):
        run_with_ray({"min-train-nodes": 4, "run-dir": str(tmp_path / "run")}, num_supernodes=2)
    assert not (tmp_path / "run").exists()
    crowd = tmp_path / "crowd"
    for user in range(2):
        (crowd / f"user_{user:02d}").mkdir(parents=True)
    code = launch.main(
        ["--run-config", f"data-dir='{crowd}' min-train-nodes=3", "--run-dir", str(tmp_path / "r")]
    )
    assert code == 2 and not (tmp_path / "r").exists()

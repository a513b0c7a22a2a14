"""Every numeric strategy key, and the scene's run-config keys, at the extremes the parser
accepts run two rounds end to end.

For each registered strategy and each numeric key of its settings, the smallest and the
largest of a ladder of values (0, 5e-324, 1e-300, ..., 1e300) that the key's own rule takes are
parsed as a user's run-config would be, built into the strategy the App builds, and run for
two rounds over three least-squares clients in process. The run must finish with a finite
global; an extreme that cannot run has to be refused by the parser instead (issue 57)."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from test_method_digests import SMALL_SCENE
from test_strategies import heterogeneous_problems, initial_state, least_squares_app

import strategies
from fedfields.config.schema import MAX_SEED, CommonSection, SceneSection
from fedfields.flower.protocol import arrays_to_state, state_to_arrays
from fedfields.methods.settings import typed_value
from simulations.in_process_grid import InProcessGrid

LADDER = (0.0, 5e-324, 1e-300, 1e-9, 1e-6, 0.5, 1 - 1e-12, 1.0, 10.0, 1e6, 1e300)
"""The values tried for each key; the smallest and largest its rule accepts are run."""
META_ONLY = {"fedmenf"}
"""Strategies of the meta tasks only (their keys are walked by the meta job's own tests)."""
LOSS_WEIGHTS = {"proximal-mu", "fedacg-beta"}
"""Keys the clients' loss reads: plain gradient descent at a fixed step (this module's
clients) diverges at a large proximal weight where the App's Adam does not, so they are
walked through the App's own ClientApp (`test_a_loss_weight_at_its_largest_trains_a_scene`)."""


def accepted(spec: object, run_key: str) -> list[float]:
    """The ladder's values the key's rule and type accept (ints for an int key)."""
    rule = spec.metadata.get("rule")  # type: ignore[attr-defined]
    values = []
    for value in LADDER:
        candidate = int(value) if isinstance(spec.default, int) else value  # type: ignore[attr-defined]
        try:
            typed_value(run_key, candidate, spec)  # type: ignore[arg-type]
        except ValueError:
            continue
        if rule is None or rule[0](candidate):
            values.append(candidate)
    return sorted(set(values))


def extremes() -> list[tuple[str, str, float]]:
    """(strategy, key, value) for each numeric key's smallest and largest accepted value."""
    cases = []
    for name, settings in sorted(strategies.strategy_settings().items()):
        if name in META_ONLY:
            continue
        for spec in fields(settings):
            default = spec.default
            if isinstance(default, bool) or not isinstance(default, int | float):
                continue
            run_key = spec.metadata["key"]
            if run_key in LOSS_WEIGHTS:
                continue
            values = accepted(spec, run_key)
            cases += [(name, run_key, value) for value in {values[0], values[-1]}]
    return cases


@pytest.mark.parametrize(("name", "run_key", "value"), extremes())
def test_a_strategy_key_at_an_accepted_extreme_runs_two_rounds(
    name: str, run_key: str, value: float
) -> None:
    config = strategies.parse_app_config({"strategy": name, run_key: value})
    strategy = strategies.make_strategy(config, min_available_nodes=3, local_steps=2)
    problems = heterogeneous_problems(3)
    app = least_squares_app(problems, 0.05, alphas=(1.0, 1.0, 1.0))
    result = strategy.start(InProcessGrid([app] * 3), state_to_arrays(initial_state()), 2)
    final = arrays_to_state(result.arrays)
    assert all(bool(torch.isfinite(v).all()) for v in final.values()), (name, run_key, value)
    assert sorted(result.train_metrics_clientapp) == [1, 2]
    assert math.isfinite(float(sum(float(v.abs().sum()) for v in final.values())))


@pytest.mark.parametrize("run_key", sorted(LOSS_WEIGHTS))
def test_a_loss_weight_at_its_largest_trains_a_scene(
    run_key: str, crowd_dir: Path, tmp_path: Path
) -> None:
    """proximal-mu and fedacg-beta at the largest value the parser takes (1e6) through two
    rounds of the App's scene job in process: the clients' losses stay finite and every
    reply is summed."""
    from simulations.federated_nerf import run_federated_nerf
    from simulations.run import client_app

    name = "fedprox" if run_key == "proximal-mu" else "fedacg"
    config = {**SMALL_SCENE, "data-dir": str(crowd_dir), "state-dir": str(tmp_path / "nodes"),
              "run-dir": str(tmp_path / "run"), "strategy": name, run_key: 1e6,
              "num-server-rounds": 2}  # fmt: skip
    grid = InProcessGrid([client_app(config)] * 3, raise_errors=True)
    run_dir = run_federated_nerf(grid, strategies.parse_app_config(config))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["num-replies"] for line in lines] == [3, 3]
    assert all(math.isfinite(line["train-loss"]) for line in lines)


# ------------------------------------------------------------------ the scene's run-config keys

SECTION_LADDER = (
    *LADDER[:5], 1e-3, 0.1, 0.5, 1.0, 10.0, 16.0, 100.0, 1000.0, 1e6, 1e300,
)  # fmt: skip
"""Float values tried for the common and scene sections' keys (their bounds among them)."""
COUNT_LADDER = (0, 1, 2, 16, 22, 32, 64, 4096, 10_000, 1 << 15, 1 << 22, 1_000_000, MAX_SEED)
"""Integer values tried; 2**63 - 1 and the like are refused by every count's bound."""
WORK_KEYS = {
    "num-server-rounds", "local-steps", "target-samples", "hash-log2-size", "field-width",
    "field-depth",
}  # fmt: skip
"""Keys whose largest value scales a run's time or memory (a million steps, 4M samples a
step, 2^22 entries a level): walked at their smallest only; their bounds refuse typos."""
DATA_KEYS = {"scene-bound"}
"""Keys whose least workable value the nodes' data sets: below it each node refuses with
an error naming itself and the key (walked at their largest)."""


def section_extremes() -> tuple[dict[str, float], dict[str, float]]:
    """The smallest and the largest value each numeric key of the common and scene sections
    takes (on the ladders), each parsed alone over the small scene's settings."""
    smallest, largest = {}, {}
    for section in (CommonSection, SceneSection):
        for spec in fields(section):
            default = spec.default
            if isinstance(default, bool) or not isinstance(default, int | float):
                continue
            key = spec.name.replace("_", "-")
            ladder = COUNT_LADDER if isinstance(default, int) else SECTION_LADDER
            taken = []
            for value in ladder:
                try:
                    strategies.parse_app_config({**SMALL_SCENE, key: value})
                except ValueError:
                    continue
                taken.append(value)
            if key not in DATA_KEYS:
                smallest[key] = taken[0]
            if key not in WORK_KEYS:
                largest[key] = taken[-1]
    return smallest, largest


@pytest.mark.parametrize("end", ["smallest", "largest"])
def test_the_scene_keys_at_their_accepted_extremes_run_two_rounds_together(
    end: str, crowd_dir: Path, tmp_path: Path
) -> None:
    """Every numeric key of the common and scene sections at the smallest (or largest) value
    the parser takes, all in one run config: the App's scene job runs two rounds in process
    and sums every sampled reply (fraction-train's smallest samples min-train-nodes)."""
    from simulations.federated_nerf import run_federated_nerf
    from simulations.run import client_app

    smallest, largest = section_extremes()
    assert smallest["downscale"] == 0.5 and largest["learning-rate"] == 0.1  # the bounds
    extremes = smallest if end == "smallest" else largest
    config = {**SMALL_SCENE, **extremes, "num-server-rounds": 2}
    config |= {"data-dir": str(crowd_dir), "state-dir": str(tmp_path / "nodes"),
               "run-dir": str(tmp_path / "run")}  # fmt: skip
    grid = InProcessGrid([client_app(config)] * 3, raise_errors=True)
    run_dir = run_federated_nerf(grid, strategies.parse_app_config(config))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sampled = 2 if end == "smallest" else 3
    assert [line["num-replies"] for line in lines] == [sampled, sampled]
    assert all(math.isfinite(line["train-loss"]) for line in lines)


@pytest.mark.parametrize(
    ("key", "value"),
    [("local-steps", 1_000_001), ("num-server-rounds", 1 << 63), ("target-samples", 1 << 23),
     ("hash-levels", 33), ("downscale", 1e300), ("downscale", 5e-324), ("learning-rate", 1.0),
     ("beta-min", 5e-324), ("scene-bound", 1e300), ("personal-density-weight", 1e6),
     ("field-width", 1 << 40), ("eval-views-per-round", 10_001)],
)  # fmt: skip
def test_a_scene_key_beyond_its_bound_is_refused_by_name(key: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"'{key}'"):
        strategies.parse_app_config({key: value})

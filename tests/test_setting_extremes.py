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
from collections.abc import Collection, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import LEGO
from test_method_digests import SMALL_SCENE, fixed_randomness  # noqa: F401 (a fixture)
from test_strategies import heterogeneous_problems, initial_state, least_squares_app

import strategies
from fedfields.config.schema import (
    MAX_SEED,
    CommonSection,
    CompressionSection,
    DPSection,
    MetaSection,
    RobustSection,
    SceneSection,
    SecureSection,
    SplitSection,
)
from fedfields.flower.protocol import arrays_to_state, state_to_arrays
from fedfields.flower.strategy import EmptyRoundsError
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
    "field-depth", "personal-width", "orbit-frames",
}  # fmt: skip
"""Keys whose largest value scales a run's time or memory (a million steps, 4M samples a
step, 2^22 entries a level): walked at their smallest only; their bounds refuse typos."""
DATA_KEYS = {"scene-bound"}
"""Keys whose least workable value the nodes' data sets: below it each node refuses with
an error naming itself and the key (walked at their largest)."""


def section_extremes() -> tuple[dict[str, float], dict[str, float]]:
    """The smallest and the largest value each numeric key of the common and scene sections
    takes (on the ladders), each parsed alone over the small scene's settings; data keys are
    left out of the smallest, work keys out of the largest."""
    smallest, largest = {}, {}
    for section in (CommonSection, SceneSection):
        low, high = accepted_extremes(section, SMALL_SCENE)
        smallest |= {key: value for key, value in low.items() if key not in DATA_KEYS}
        largest |= {key: value for key, value in high.items() if key not in WORK_KEYS}
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


# ------------------------------------------------------------------ the other sections' keys


def accepted_extremes(
    section: type, base: Mapping[str, Any], skip: Collection[str] = (), *, defaults: bool = True
) -> tuple[dict[str, float], dict[str, float]]:
    """The smallest and largest value (on the ladders) each numeric key of `section` takes,
    each parsed alone over `base`; `skip` leaves keys out, and without `defaults` a key's
    default is not taken (a 0 that means "the task's preset")."""
    smallest, largest = {}, {}
    for spec in fields(section):
        default, key = spec.default, spec.name.replace("_", "-")
        if isinstance(default, bool) or not isinstance(default, int | float) or key in skip:
            continue
        ladder = COUNT_LADDER if isinstance(default, int) else SECTION_LADDER
        taken = []
        for value in ladder:
            try:
                strategies.parse_app_config({**base, key: value})
            except ValueError:
                continue
            if defaults or value != default:
                taken.append(value)
        if taken:  # none: a key `base` does not read (another scheme's), refused as unread
            smallest[key], largest[key] = taken[0], taken[-1]
    return smallest, largest


META_BASE = {
    "task": "faces", "num-server-rounds": 2, "num-clients": 4, "clients-per-round": 2,
    "outer-steps": 2, "inner-steps": 1, "tto-steps": 2, "field-width": 16, "field-depth": 2,
    "seed": 3, "meta-learner": "fedmenf",
}  # fmt: skip
META_SMALLEST_ONLY = {"num-clients", "clients-per-round", "outer-steps", "inner-steps", "tto-steps"}
"""Meta keys whose largest is work (a million outer steps) or more clients than the faces
hold (refused by the task's data, naming the count): walked at their smallest. A 0 that means
the task's preset (counts, rates) is the default run, a benchmark's length: the least value
besides it is walked."""
PHOTO_KEYS = {"photo-crop", "photo-size"}
"""Read by task photos only: walked in a photos run of their own."""


@pytest.mark.usefixtures("fixed_randomness")
@pytest.mark.parametrize("end", ["smallest", "largest"])
def test_the_meta_keys_at_their_accepted_extremes_run_two_rounds_together(
    end: str, tmp_path: Path
) -> None:
    """Every numeric meta key at the smallest (or largest) value the parser takes, together in
    one FedMeNF faces run of two rounds in process (gamma only beside privacy-budget 0, which
    reads it); then photo-size and photo-crop at their smallest in a photos run."""
    from simulations.meta_job import run_meta_job
    from simulations.run import client_app

    smallest, largest = accepted_extremes(MetaSection, META_BASE, PHOTO_KEYS, defaults=False)
    assert largest["inner-lr"] == 1.0 and largest["memorising-bound"] == 1e6  # the bounds
    extremes = smallest if end == "smallest" else largest
    if end == "largest":
        extremes = {k: v for k, v in extremes.items() if k not in META_SMALLEST_ONLY}
    gamma = extremes.pop("gamma")  # a privacy budget adapts gamma: walked beside budget 0
    runs = [{**META_BASE, **extremes}, {**META_BASE, "gamma": gamma}]
    if end == "smallest":
        runs.append({**META_BASE, "task": "photos", "photo-size": 7, "photo-crop": 7})
    for index, config in enumerate(runs):
        config["run-dir"] = str(tmp_path / f"meta-{index}")
        nodes = int(config["num-clients"])  # one node per client, as the launcher starts them
        grid = InProcessGrid([client_app(config)] * nodes, raise_errors=True)
        run_dir = run_meta_job(grid, strategies.parse_app_config(config))
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rounds = [line for line in lines if "num-replies" in line]
        assert len(rounds) == 2 and all(line["num-replies"] >= 1 for line in rounds), config


@pytest.mark.parametrize(
    ("key", "value"),
    [("inner-lr", 1e300), ("outer-lr", 1.5), ("tto-lr", 1e6), ("memorising-bound", 1e300),
     ("photo-size", 1), ("outer-steps", 1_000_001), ("num-clients", 1 << 31),
     ("split-steps", 1 << 40), ("split-batch-rays", 1 << 17), ("split-samples", 1025),
     ("split-noise-c", 1e300), ("split-label-noise", 101.0)],
)  # fmt: skip
def test_a_meta_or_split_key_beyond_its_bound_is_refused_by_name(key: str, value: float) -> None:
    base = {"mode": "split"} if key.startswith("split-") else {"task": "faces"}
    with pytest.raises(ValueError, match=f"'{key}'"):
        strategies.parse_app_config({**base, key: value})


SPLIT_BASE = {
    "mode": "split", "downscale": 8.0, "split-steps": 4, "split-batch-rays": 64,
    "split-samples": 24, "split-record-every": 2, "split-attack": False, "hash-log2-size": 10,
    "hash-levels": 2, "hash-max-resolution": 32,
}  # fmt: skip
SPLIT_SMALLEST_ONLY = {"split-steps", "split-batch-rays", "split-samples", "split-record-every"}
"""Split counts whose largest is work (a million exchanges of 65,536 rays): smallest only."""


@pytest.mark.parametrize("end", ["smallest", "largest"])
def test_the_split_keys_at_their_accepted_extremes_run_together(end: str, tmp_path: Path) -> None:
    """Every numeric split key at the smallest (or largest) value the parser takes, together:
    the split job runs its exchanges in process with a finite loss (the S2NeRF noise scale at
    100; the parser refuses it beside NoisyLabel's std, one defence a run)."""
    from simulations.run import client_app
    from simulations.split_job import run_split_job

    smallest, largest = accepted_extremes(SplitSection, SPLIT_BASE)
    assert largest["split-noise-c"] == 100.0 and largest["split-label-noise"] == 100.0
    extremes = smallest if end == "smallest" else {
        k: v for k, v in largest.items() if k not in SPLIT_SMALLEST_ONLY
    }  # fmt: skip
    if end == "largest":  # one defence a run: NoisyLabel's std at its largest walked alone
        with pytest.raises(ValueError, match="not both"):
            strategies.parse_app_config({**SPLIT_BASE, **extremes})
        extremes.pop("split-label-noise")
    config = {**SPLIT_BASE, **extremes, "data-dir": str(LEGO), "run-dir": str(tmp_path / "split"),
              "state-dir": str(tmp_path / "split.nodes")}  # fmt: skip
    grid = InProcessGrid([client_app(config)], raise_errors=True)
    run_dir = run_split_job(grid, strategies.parse_app_config(config))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines and all(math.isfinite(line["loss"]) for line in lines)


DP_BASE = {**SMALL_SCENE, "strategy": "fedavg", "dp-noise-multiplier": 1.0, "dp-clip-norm": 1.0,
           "dp-adaptive-clipping": True, "num-server-rounds": 2}  # fmt: skip


@pytest.mark.usefixtures("fixed_randomness")
@pytest.mark.parametrize("end", ["smallest", "largest"])
def test_the_dp_keys_at_their_accepted_extremes_finish_two_rounds_together(
    end: str, crowd_dir: Path, tmp_path: Path
) -> None:
    """Every numeric DP key at the smallest (or largest) value the parser takes, together, with
    adaptive clipping on, through two rounds of the scene job. At the smallest the run sums
    every reply; at the largest (z = 1000, C = 1e6, the pre-flight check lifted by
    dp-max-noise-ratio at its largest) round 1's noise wrecks the model, so round 2's clients
    fail, counted, and the run still finishes. With the check at its default the same plan is
    refused before anything is sent, naming dp-max-noise-ratio."""
    from simulations.federated_nerf import run_federated_nerf
    from simulations.run import client_app

    smallest, largest = accepted_extremes(DPSection, DP_BASE, {"dp-gradient-clip-norm"})
    assert smallest["dp-noise-multiplier"] == 1e-9 and largest["dp-noise-multiplier"] == 1e3
    extremes = smallest if end == "smallest" else largest
    config = {**DP_BASE, **extremes, "data-dir": str(crowd_dir),
              "state-dir": str(tmp_path / "nodes"), "run-dir": str(tmp_path / "run")}  # fmt: skip
    grid = InProcessGrid([client_app(config)] * 3)
    run_dir = run_federated_nerf(grid, strategies.parse_app_config(config))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and lines[0]["num-replies"] == 3
    if end == "smallest":
        assert lines[1]["num-replies"] == 3
    else:
        assert lines[1]["num-replies"] + lines[1]["num-failures"] == 3
        checked = {**config, "dp-max-noise-ratio": DPSection.dp_max_noise_ratio,
                   "run-dir": str(tmp_path / "refused")}  # fmt: skip
        with pytest.raises(ValueError, match="dp-max-noise-ratio"):
            run_federated_nerf(InProcessGrid([client_app(checked)] * 3),
                               strategies.parse_app_config(checked))  # fmt: skip


@pytest.mark.parametrize(
    ("key", "value"),
    [("dp-noise-multiplier", 5e-324), ("dp-noise-multiplier", 1e300), ("dp-clip-norm", 1e300),
     ("dp-gradient-clip-norm", 1e7)],
)  # fmt: skip
def test_a_dp_key_beyond_its_bound_is_refused_by_name(key: str, value: float) -> None:
    with pytest.raises(ValueError, match=key):
        strategies.parse_app_config({"dp-noise-multiplier": 1.0, "dp-clip-norm": 1.0, key: value})


ROUND_CASES = {
    "lowrank, mean": {"compression": "lowrank", "compression-download": True},
    "quantise, trimmed-mean": {"compression": "quantise", "aggregation-rule": "trimmed-mean"},
    "topk, krum": {"compression": "topk", "aggregation-rule": "krum"},
    "multi-krum": {"aggregation-rule": "multi-krum"},
}
"""Each compression scheme and robust rule, so every key of the two sections is read once."""


@pytest.mark.parametrize("end", ["smallest", "largest"])
@pytest.mark.parametrize("case", sorted(ROUND_CASES))
def test_the_compression_and_robust_keys_at_their_accepted_extremes_finish_two_rounds(
    case: str, end: str, crowd_dir: Path, tmp_path: Path
) -> None:
    """Every numeric key of the compression and robust sections that `case` reads, at the
    smallest (or largest) value the parser takes, together: FedAvg's scene job finishes two
    rounds in process, each reply summed, dropped or failed and counted. (A robust rule that
    assumes more malicious clients than a round of 3 can hold forms no aggregate, and says
    so: the run then ends with one error naming the rule's shortfall.)"""
    from simulations.federated_nerf import run_federated_nerf
    from simulations.run import client_app

    base = {**SMALL_SCENE, "strategy": "fedavg", **ROUND_CASES[case]}
    found = [accepted_extremes(section, base) for section in (CompressionSection, RobustSection)]
    extremes = {k: v for pair in found for k, v in pair[0 if end == "smallest" else 1].items()}
    config = {**base, **extremes, "data-dir": str(crowd_dir),
              "state-dir": str(tmp_path / "nodes"), "run-dir": str(tmp_path / "run")}  # fmt: skip
    grid = InProcessGrid([client_app(config)] * 3)
    if "krum" in case and end == "largest":  # f = 1,000,000: no round of 3 can hold it
        with pytest.raises(EmptyRoundsError, match="num-malicious = 1000000 needs 2000003"):
            run_federated_nerf(grid, strategies.parse_app_config(config))
        return
    run_dir = run_federated_nerf(grid, strategies.parse_app_config(config))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    for line in lines:
        assert line["num-replies"] + line["num-failures"] == 3, (extremes, line)


SECURE_BASE = {**SMALL_SCENE, "strategy": "fedavg", "secure-aggregation": True,
               "min-train-nodes": 3}  # fmt: skip


@pytest.mark.parametrize("end", ["smallest", "largest"])
def test_the_secure_aggregation_keys_at_their_accepted_extremes_finish_two_rounds(
    end: str, crowd_dir: Path, tmp_path: Path
) -> None:
    """Every numeric secagg-* key at the smallest (or largest) value the parser takes: FedAvg
    over SecAgg+ finishes two scene rounds in process, each sampled reply summed or counted.
    Three ends depend on the round, not the parser, and end the run with one error naming
    the key: secagg-max-exponent 0, which no value of the field fits, and a share or
    threshold count above the round's 3 clients, a threshold no round reaches (Flower's
    SecAgg+ workflow takes it as given)."""
    from simulations.federated_nerf import run_federated_nerf
    from simulations.run import client_app

    smallest, largest = accepted_extremes(SecureSection, SECURE_BASE)
    extremes = smallest if end == "smallest" else largest
    if end == "smallest":
        refused = {"secagg-max-exponent": "secagg-max-exponent"}
    else:
        refused = dict.fromkeys(
            ("secagg-num-shares", "secagg-reconstruction-threshold"),
            "secagg-reconstruction-threshold and secagg-num-shares",
        )
    runs = [({k: v for k, v in extremes.items() if k not in refused}, None)]
    runs += [({key: extremes[key]}, message) for key, message in refused.items()]
    for index, (extra, message) in enumerate(runs):
        config = {**SECURE_BASE, **extra, "data-dir": str(crowd_dir),
                  "state-dir": str(tmp_path / f"n{index}"),
                  "run-dir": str(tmp_path / f"r{index}")}  # fmt: skip
        grid = InProcessGrid([client_app(config)] * 3)
        if message is not None:
            with pytest.raises(EmptyRoundsError, match=message):
                run_federated_nerf(grid, strategies.parse_app_config(config))
            continue
        run_dir = run_federated_nerf(grid, strategies.parse_app_config(config))
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert len(lines) == 2
        for line in lines:
            assert line["num-replies"] + line["num-failures"] == 3, (extra, line)

"""The run-config by sections: validation messages, mode checks, and the generated reference."""

from __future__ import annotations

import json
import time
import tomllib
from pathlib import Path

import pytest
import torch
from flwr.app import Context, RecordDict

from clients.split_client import scene_dir
from fedfields.config import META_PRESETS, MetaSettings, meta_settings
from fedfields.config.reference import reference
from fedfields.config.schema import (
    META_TASKS,
    MetaSection,
    without_ignored_keys,
)
from fedfields.flower.node import (
    VERSION_KEY,
    NodeState,
    RunAttempt,
    is_simulated,
    node_data_dir,
    node_state_dir,
)
from strategies import parse_app_config, strategy_settings

DOCS = Path(__file__).resolve().parents[1] / "docs" / "RUN_CONFIG.md"


def test_the_reference_in_docs_is_current() -> None:
    assert DOCS.read_text() == reference(strategy_settings()), (
        "docs/RUN_CONFIG.md is stale: run python -m strategies.reference docs/RUN_CONFIG.md"
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
    text = reference(strategy_settings())
    for key in parse_app_config({}).to_run_config():
        assert text.count(f"| `{key}` |") == 1, key


def test_keys_land_in_their_sections() -> None:
    config = parse_app_config(
        {
            "local-steps": 7,
            "secure-aggregation": True,
            "min-train-nodes": 3,
            "round-timeout": 30.0,
            "seed": 3,
            "aggregation-rule": "mean",
            "max-num-examples": 10.0,
        }
    )
    assert config.scene.local_steps == 7
    assert config.secure.secure_aggregation_config() is not None
    assert config.deployment.round_timeout == 30.0 and config.common.seed == 3
    assert config.robust.max_num_examples == 10.0 and config.robust.aggregation_rule == "mean"
    assert parse_app_config(config.to_run_config()) == config


def test_an_unknown_key_is_refused_with_the_closest_one() -> None:
    with pytest.raises(
        ValueError, match="unknown run-config key 'local-stepz'; did you mean 'local-steps'"
    ):
        parse_app_config({"local-stepz": 3})


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
        parse_app_config(run_config)


def test_keys_of_the_run_and_shared_keys_are_accepted_in_every_mode() -> None:
    faces = parse_app_config(
        {"task": "faces", "strategy": "fedprox", "proximal-mu": 0.5, "outer-lr": 0.02}
    )
    assert faces.settings.proximal_mu == 0.5 and meta_settings(faces).outer_lr == 0.02
    split = parse_app_config(
        {"mode": "split", "split-steps": 5, "seed": 2, "round-timeout": 9.0, "hash-levels": 8}
    )
    assert split.split.split_steps == 5 and split.common.seed == 2
    assert split.deployment.round_timeout == 9.0 and split.scene.hash_levels == 8
    # the same key at its default never counts as "used", whatever the mode
    assert parse_app_config({"task": "video", "local-steps": 32}).common.task == "video"


@pytest.mark.parametrize(
    ("run_config", "message"),
    [
        ({"local-steps": 0}, r"'local-steps' must be in \[1, 1000000\], got 0"),
        ({"fraction-train": 1.5}, "'fraction-train' must be in \\(0, 1\\], got 1.5"),
        (
            {"hash-backend": "cuda"},
            "'hash-backend' must be one of \\('auto', 'torch', 'triton', 'tcnn'\\), got 'cuda'",
        ),
        ({"seed": "one"}, "'seed' must be int, got 'one'"),
        ({"task": "faces", "gamma": 2.0}, "'gamma' must be in \\[0, 1\\], got 2.0"),
        ({"secagg-timeout": -1.0}, "run-config: .*timeout"),
        ({"task": "faces", "strategy": "decentnerf"}, "'decentnerf' is for task 'scene' only"),
    ],
)
def test_a_bad_value_names_its_key_and_value(run_config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_app_config(run_config)


# ------------------------------------------------------------------ issue 18, item 4


@pytest.mark.parametrize(
    ("run_config", "message"),
    [
        ({"eval-views-per-round": 0}, r"'eval-views-per-round' must be in \[1, 10000\], got 0"),
        ({"eval-views-per-round": -2}, r"'eval-views-per-round' must be in \[1, 10000\], got -2"),
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
        ({"alpha-max": 0.0}, r"'alpha-max' must be in \[1, 1e\+06\], got 0.0"),
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
        parse_app_config(run_config)


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
    parse_app_config(run_config)


def test_the_launchers_node_count_is_checked_before_anything_runs(tmp_path: Path) -> None:
    from simulations import launch
    from simulations.run import run_with_ray

    config = parse_app_config({"min-train-nodes": 4})
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


# ------------------------------------------------------------------ issue 33, item 4


def test_the_measured_best_is_the_default_and_the_paper_one_key_away() -> None:
    """memorising-bound 0.15 (docs/BENCHMARKS.md) by default; 0 is FedMeNF's Eq. 10 as
    published, and reaches the clients' loss as no clamp at all."""
    from fedfields.train.builders import meta_config

    def clamp(run_config: dict) -> float | None:
        config = parse_app_config({"task": "faces", **run_config})
        settings = meta_settings(config)
        return meta_config(config, settings, outer_steps=1, seed=0).memorising_bound

    assert clamp({}) == 0.15
    assert clamp({"memorising-bound": 0.0}) is None
    pyproject = tomllib.loads((DOCS.parents[1] / "pyproject.toml").read_text())
    assert pyproject["tool"]["flwr"]["app"]["config"]["memorising-bound"] == 0.15


@pytest.mark.parametrize(
    ("run_config", "key", "mode"),
    [
        ({"mode": "split", "secure-aggregation": True}, "secure-aggregation", "mode='split'"),
        ({"mode": "split", "aggregation-rule": "median"}, "aggregation-rule", "mode='split'"),
        ({"mode": "split", "secagg-timeout": 5.0}, "secagg-timeout", "mode='split'"),
        ({"mode": "split", "min-train-nodes": 3}, "min-train-nodes", "mode='split'"),
        ({"mode": "split", "min-available-nodes": 2}, "min-available-nodes", "mode='split'"),
        ({"mode": "split", "strategy": "fedavg"}, "strategy", "mode='split'"),
        ({"mode": "split", "num-server-rounds": 3}, "num-server-rounds", "mode='split'"),
        ({"mode": "split", "local-steps": 3}, "local-steps", "mode='split'"),
        ({"mode": "split", "alpha-lr": 0.5}, "alpha-lr", "mode='split'"),
        ({"mode": "split", "eval-scene-dir": "/x"}, "eval-scene-dir", "mode='split'"),
        ({"field-depth": 3}, "field-depth", "mode='federated'"),
        ({"task": "faces", "eval-scene-dir": "/x"}, "eval-scene-dir", "mode='federated'"),
        ({"task": "photos", "downscale": 2.0}, "downscale", "task='photos' mode='federated'"),
        (
            {"task": "faces", "meta-learner": "maml", "gamma": 0.5},
            "gamma",
            "mode='federated' strategy='fedmenf' meta-learner='maml'",
        ),
        (
            {"task": "faces", "meta-learner": "reptile", "memorising-bound": 0.3},
            "memorising-bound",
            "meta-learner='reptile'",
        ),
        ({"task": "faces", "privacy-budget": 1e-3, "gamma": 0.5}, "gamma", "mode='federated'"),
        ({"strategy": "fedavg", "proximal-mu": 0.1}, "proximal-mu", "strategy='fedavg'"),
        ({"task": "video", "scaffold-global-lr": 0.5}, "scaffold-global-lr", "strategy='fedmenf'"),
        ({"strategy": "fedavg", "alpha-max": 5.0}, "alpha-max", "mode='federated'"),
        ({"secagg-timeout": 5.0}, "secagg-timeout", "mode='federated'"),
        ({"strategy": "fedavg", "trim-fraction": 0.1}, "trim-fraction", "mode='federated'"),
        (
            {"secure-aggregation": True, "min-train-nodes": 3, "max-update-norm": 5.0},
            "max-update-norm",
            "mode='federated'",
        ),
    ],
)
def test_a_changed_key_the_run_does_not_read_is_refused(
    run_config: dict, key: str, mode: str
) -> None:
    """One error, naming the key and the run's task and mode (and, where they decide,
    strategy and learner); the same key at its default passes."""
    with pytest.raises(ValueError) as error:
        parse_app_config(run_config)
    message = str(error.value)
    assert f"'{key}'" in message and mode in message and "\n" not in message, message
    default = parse_app_config({}).to_run_config()[key]
    parse_app_config({**run_config, key: default})


def test_each_strategy_key_is_read_only_by_the_strategies_declaring_it() -> None:
    """A strategy's own key, changed, is refused under every registered strategy that does
    not declare it and accepted under those that do: the schema reads the registry."""
    from strategies import STRATEGIES

    declared = {name: set(settings.keys()) for name, (_, settings) in STRATEGIES.items()}
    for run_key in set().union(*declared.values()):
        reader = next(name for name, keys in declared.items() if run_key in keys)
        spec = STRATEGIES[reader][1].keys()[run_key]
        changed = spec.default * 0.5 if spec.default else 0.5
        for name, keys in declared.items():
            if name == "fedmenf":  # the meta tasks' strategy; the others run on the scene too
                continue
            run_config = {"strategy": name, run_key: changed}
            if run_key in keys:
                assert parse_app_config(run_config).to_run_config()[run_key] == changed
            else:
                with pytest.raises(ValueError, match=f"'{run_key}' = .* is read only with"):
                    parse_app_config(run_config)


def test_the_meta_job_samples_at_least_min_train_nodes(tmp_path: Path) -> None:
    """clients-per-round 2 of video's 6 with min-train-nodes 4: the round trains 4 clients."""
    from simulations.in_process_grid import InProcessGrid
    from simulations.meta_job import run_meta_job
    from simulations.run import client_app

    config = {
        "task": "video",
        "run-dir": str(tmp_path / "run"),
        "num-server-rounds": 1,
        "clients-per-round": 2,
        "min-train-nodes": 4,
        "outer-steps": 1,
        "field-width": 8,
        "field-depth": 2,
        "tto-steps": 1,
    }
    grid = InProcessGrid([client_app(config)] * 6, raise_errors=True)
    run_meta_job(grid, parse_app_config(config), observers=[])
    trained = {m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type == "train"}
    assert len(trained) == 4


def test_the_meta_jobs_first_round_waits_for_min_available_nodes() -> None:
    """3 of 6 clients connected: with min-available-nodes 3 the round starts at once; left
    at 0 it waits round-timeout for all 6, then goes on with the 3."""
    from simulations.in_process_grid import InProcessGrid
    from simulations.meta_job import make_meta_strategy

    grid = InProcessGrid([lambda message, context: message] * 3)

    def seconds_to_start(run_config: dict) -> float:
        config = parse_app_config({"task": "video", "clients-per-round": 2, **run_config})
        strategy = make_meta_strategy(config, meta_settings(config))
        started = time.monotonic()
        wanted = max(strategy.min_available_nodes, strategy.min_train_nodes)
        assert len(strategy.sampler.connected(grid, wanted, strategy.min_train_nodes)) == 3
        return time.monotonic() - started

    # did not wait for its 30 s round-timeout (a bound no load on the machine reaches)
    assert seconds_to_start({"min-available-nodes": 3, "round-timeout": 30.0}) < 15.0
    assert seconds_to_start({"round-timeout": 0.6}) >= 0.6


class RecordingGrid:
    """A grid of one silent node that records the timeout of each exchange."""

    def __init__(self, nodes: list[int]) -> None:
        self.nodes, self.timeouts = nodes, []

    def get_node_ids(self) -> list[int]:
        return self.nodes

    def send_and_receive(self, messages: object, *, timeout: float | None = None) -> list:
        self.timeouts.append(timeout)
        return []


def test_the_split_server_waits_round_timeout(tmp_path: Path) -> None:
    """round-timeout bounds the split server's wait for its node and for each reply."""
    from simulations.split_job import run_split_job

    config = {"mode": "split", "round-timeout": 0.4, "hash-log2-size": 10, "hash-levels": 2}
    silent = RecordingGrid([7])
    with pytest.raises(TimeoutError, match=r"node 7 did not reply within 0.4 s .*round-timeout"):
        run_split_job(
            silent,  # type: ignore[arg-type]
            parse_app_config({**config, "run-dir": str(tmp_path / "a")}),
            observers=[],
        )
    assert silent.timeouts == [0.4]
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no client connected within 0.4 s"):
        run_split_job(
            RecordingGrid([]),  # type: ignore[arg-type]
            parse_app_config({**config, "run-dir": str(tmp_path / "b")}),
            observers=[],
        )
    assert time.monotonic() - started >= 0.4  # it waited round-timeout, then gave up


# --------------------------------------------------- a node's data and state directories


def _context(node_config: dict, run_config: dict) -> Context:
    return Context(
        run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config=run_config
    )


SIMULATED = {"partition-id": 1, "num-partitions": 2}  # what Flower's simulation engine gives


def test_a_simulated_node_takes_the_launchers_roots(tmp_path: Path) -> None:
    (tmp_path / "data" / "user_01").mkdir(parents=True)
    roots = {"data-dir": str(tmp_path / "data"), "state-dir": str(tmp_path / "state")}
    context = _context(SIMULATED, roots)
    assert is_simulated(context)
    assert node_data_dir(context, "user") == tmp_path / "data" / "user_01"
    assert node_state_dir(context) == tmp_path / "state" / "node_01"


@pytest.mark.parametrize(
    "node_config",
    [{}, {**SIMULATED, "state-dir": "/somewhere/own"}, {"partition-id": 1}],
)
def test_a_deployed_node_without_data_dir_refuses_naming_the_key(
    node_config: dict, tmp_path: Path
) -> None:
    """The server's run-config roots are there and valid, and never read."""
    (tmp_path / "data" / "user_01").mkdir(parents=True)
    roots = {"data-dir": str(tmp_path / "data"), "state-dir": str(tmp_path / "state")}
    context = _context(node_config, roots)
    assert not is_simulated(context)
    with pytest.raises(
        ValueError,
        match=r"^node 7: node-config has no 'data-dir': a deployed SuperNode must be started "
        r"with --node-config \"data-dir='/path'\"",
    ):
        node_data_dir(context, "user")
    assert node_state_dir(context) == (
        Path("/somewhere/own") if node_config.get("state-dir") else None
    )
    NodeState(context)  # its state stays in Flower's context or its own folder
    assert not (tmp_path / "state").exists()


def test_a_deployed_node_reads_only_its_node_config(tmp_path: Path) -> None:
    own, server = tmp_path / "own", tmp_path / "server"
    (own / "data").mkdir(parents=True)
    (server / "user_01").mkdir(parents=True)
    node_config = {**SIMULATED, "data-dir": str(own / "data"), "state-dir": str(own / "state")}
    context = _context(node_config, {"data-dir": str(server), "state-dir": str(server)})
    assert node_data_dir(context, "user") == own / "data"
    assert node_state_dir(context) == own / "state"


def test_a_deployed_split_node_refuses_the_servers_scene() -> None:
    """The split client's scene: run-config data-dir naming a scene is a virtual node's
    only; a deployed node without node-config data-dir refuses, naming the key."""
    lego = DOCS.parents[1] / "data" / "lego"
    assert (
        scene_dir(_context({"partition-id": 0, "num-partitions": 1}, {"data-dir": str(lego)}))
        == lego
    )
    with pytest.raises(ValueError, match="node-config has no 'data-dir'"):
        scene_dir(_context({"state-dir": "/tmp/own"}, {"data-dir": str(lego)}))


def test_a_run_saved_under_older_defaults_reads_back(tmp_path: Path) -> None:
    """A config.json holds every key at the defaults of its day: a scene run saved with
    memorising-bound 0 (before it defaulted to 0.15) is audited and resumed, since the run
    never read the key; a FedMeNF run that read it keeps its 0."""
    from fedfields.audit.pipeline import RunError, open_run
    from fedfields.flower.resume import ResumeError
    from simulations.job import open_run_dir

    saved = {**parse_app_config({}).to_run_config(), "memorising-bound": 0.0}
    with pytest.raises(ValueError, match="'memorising-bound' belongs to the meta section"):
        parse_app_config(saved)
    assert parse_app_config(without_ignored_keys(saved)) == parse_app_config({})
    fedmenf = {**saved, "task": "faces"}
    assert without_ignored_keys(fedmenf)["memorising-bound"] == 0.0
    maml = {**fedmenf, "meta-learner": "maml"}
    assert "memorising-bound" not in without_ignored_keys(maml)
    run = tmp_path / "old-run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({**saved, "run-dir": str(run)}))
    with pytest.raises(RunError, match="no checkpoint.pt"):  # past the config
        open_run(run)
    resumed = parse_app_config({"run-dir": str(run), "resume": True})
    with pytest.raises(ResumeError) as refused:  # past the comparison, at the missing resume.pt
        open_run_dir(resumed)
    assert "differs" not in str(refused.value)


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("personal.pt", b"\x80\x02 cut", "not a readable node state 'personal'"),
        ("personal.pt", None, "not named tensors"),
        ("alpha.json", b'{"alpha": 0.', "not a readable node state 'alpha'"),
        ("alpha.json", b"[1, 2]", "not a JSON object"),
    ],
)
def test_a_damaged_node_state_file_is_one_error_naming_it(
    tmp_path: Path, name: str, content: bytes | None, reason: str
) -> None:
    """A node whose state file was cut short (a crash outside the atomic writes, a full disk)
    or holds something else: one ValueError naming the file, not torch's or json's own."""
    own = tmp_path / "own"
    node_config = {"data-dir": str(own / "data"), "state-dir": str(own / "state")}
    state = NodeState(_context(node_config, {}))
    path = own / "state" / name
    if content is None:
        torch.save([1, 2], path)
    else:
        path.write_bytes(content)
    read = state.tensors if name.endswith(".pt") else state.values
    with pytest.raises(ValueError, match=reason) as error:
        read(name.split(".")[0])
    assert str(path) in str(error.value)


def test_node_state_versions_follow_the_rounds_the_server_kept(tmp_path: Path) -> None:
    """Written in rounds 1 and 2 of attempt 0 (the server died in round 2 after round 1's
    checkpoint): the continued run (resume-points "1") reads round 1's version in round 2 and
    after, tensors and values alike; its own writes replace the killed round's; an old file
    without a version reads as it is; a bad stamp is one error naming the file."""
    node_config = {"data-dir": str(tmp_path / "data"), "state-dir": str(tmp_path / "state")}
    context = _context(node_config, {})

    def state(server_round: int, points: str = "") -> NodeState:
        return NodeState(context, RunAttempt.of_config(server_round, {"resume-points": points}))

    for server_round in (1, 2):
        state(server_round).put_tensors("field", {"w": torch.full((2,), float(server_round))})
        state(server_round).put_values("alpha", {"alpha": server_round})
    assert state(3).tensors("field")["w"].tolist() == [2.0, 2.0]  # attempt 0 goes on
    for server_round in (2, 3):  # continued after round 1: the killed round's is not kept
        assert state(server_round, "1").tensors("field")["w"].tolist() == [1.0, 1.0]
        assert state(server_round, "1").values("alpha") == {"alpha": 1}
    state(2, "1").put_tensors("field", {"w": torch.full((2,), 20.0)})
    assert state(3, "1").tensors("field")["w"].tolist() == [20.0, 20.0]
    assert state(3, "1,1").tensors("field")["w"].tolist() == [1.0, 1.0]  # killed again in 2
    assert state(2, "1").tensors("nothing") is None
    torch.save({"w": torch.zeros(1)}, tmp_path / "state" / "old.pt")  # before versions
    assert state(5, "1,3").tensors("old")["w"].tolist() == [0.0]
    torch.save({"w": torch.zeros(1), VERSION_KEY: torch.zeros(3)}, tmp_path / "state" / "bad.pt")
    with pytest.raises(ValueError, match="bad.pt is not a readable node state 'bad': a bad ver"):
        state(1).tensors("bad")


@pytest.mark.parametrize(
    ("run_config", "reason"),
    [
        ({"round-timeout": 1e308}, r"'round-timeout' must be in \(0, 1e\+07\] seconds"),
        ({"secure-aggregation": True, "secagg-timeout": 1e9}, r"secagg-timeout must be in \[0"),
    ],
)
def test_a_timeout_python_cannot_wait_is_refused_when_parsed(run_config: dict, reason: str) -> None:
    """threading.Event().wait(1e308) raises OverflowError: such a timeout, accepted, would
    crash the first wait of the run; it is refused with the other run-config errors."""
    with pytest.raises(ValueError, match=reason):
        parse_app_config(run_config)


def test_the_list_of_strategies_comes_from_the_registry_alone() -> None:
    """Issue 56, point 5: the reference lists the registry's strategies, generated; no other
    file keeps the list by hand (the schema's help, pyproject's comment, the docs)."""
    registered = list(strategy_settings())
    paragraphs = reference(strategy_settings()).split("\n\n")
    line = next(text for text in paragraphs if "Registered strategies" in text)
    assert line.endswith(", ".join(f"`{name}`" for name in registered) + ".")
    root = DOCS.parents[1]
    others = [name for name in registered if name not in ("decentnerf", "fedmenf", "fedavg")]
    for path in [root / "pyproject.toml", root / "fedfields" / "config" / "schema.py",
                 *sorted((root / "docs").glob("*.md"))]:  # fmt: skip
        text = path.read_text()
        if path != DOCS:
            assert not all(name in text for name in others), f"{path} lists the strategies"

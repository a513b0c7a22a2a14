"""What a SuperNode knows about itself: which client it is, its own data, its private state.

Node-config (a deployed SuperNode's `--node-config`) names everything a node needs:
  partition-id, num-partitions  which client this node is (faces and video pick their data by it)
  data-dir                      this node's own data: a crowd user folder, an object folder, or
                                the split-learning scene
  state-dir                     a node-local directory for the client's private state
  device                        where the node trains and renders: auto (CUDA when visible, the
                                default), cpu, cuda or cuda:N (`node_device`)
  max-splats                    the most Gaussians (shared and personal) this node holds; a
                                splat run above it is refused by name (`check_splat_limit`)
In simulation Flower passes only partition-id and num-partitions; the launcher then names a
root in run-config `data-dir` (`state-dir`), and virtual node i takes `<root>/<prefix>_<i:02d>`
or `_<i:03d>` (`<root>/node_<i:02d>`). The run-config roots are never read by the ServerApp.

Simulated or deployed (`is_simulated`): Flower 1.41's simulation engine gives every virtual
node exactly {partition-id, num-partitions} as node-config
(`flwr.server.superlink.fleet.vce.vce_api`), so that node-config, and only that one, marks a
virtual node. Any other node-config (empty, or naming anything else, `device` included) is a
deployed SuperNode's: its directories come from its node-config only, never from the server's
run-config; without `data-dir` a node that needs data refuses, and without `state-dir` its
state stays in Flower's context. A deployed node is therefore started with at least its own
`state-dir` (docs/DEPLOY.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from torch import Tensor

from fedfields import atomic
from fedfields.devices import parse_device
from fedfields.flower.protocol import (
    RESUME_POINTS,
    USER_KEY,
    USER_RECORD,
    arrays_to_state,
    state_to_arrays,
)

PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"
SIMULATION_NODE_CONFIG = frozenset({PARTITION_ID, NUM_PARTITIONS})
"""The node-config keys Flower's simulation engine gives a virtual node, and all of them."""
DATA_DIR = "data-dir"
STATE_DIR = "state-dir"
DEVICE = "device"
MAX_SPLATS = "max-splats"


def client_index(context: Context) -> int:
    """This node's client index: node-config `partition-id` (`user` is the older name)."""
    node_config = context.node_config
    for key in (PARTITION_ID, "user"):
        if key in node_config:
            return int(node_config[key])
    raise ValueError(
        f"node {context.node_id}: node-config needs '{PARTITION_ID}' (which client this node is)"
    )


def is_simulated(context: Context) -> bool:
    """Whether this node is a simulation's virtual node: its node-config is exactly what
    Flower's simulation engine gives one (`SIMULATION_NODE_CONFIG`), else it is deployed."""
    return set(context.node_config) == SIMULATION_NODE_CONFIG


def node_device(context: Context) -> torch.device:
    """The device this node trains and renders on: node-config `device` (default auto: CUDA
    when this process sees one, as a Ray actor given a `--client-gpus` share does).

    A malformed value, or a CUDA device this process cannot see, is one ValueError naming
    the node, the key and the value.
    """
    value = str(context.node_config.get(DEVICE, "auto"))
    return parse_device(value, f"node {context.node_id}: node-config '{DEVICE}'")


def check_splat_limit(context: Context, shared: int, personal: int) -> None:
    """Raise ValueError when a splat run's `shared` + `personal` Gaussians exceed node-config
    `max-splats` (a node's memory budget; absent: no limit), naming the node, key and counts."""
    if MAX_SPLATS not in context.node_config:
        return
    where = f"node {context.node_id}: node-config '{MAX_SPLATS}'"
    raw = context.node_config[MAX_SPLATS]
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise ValueError(f"{where} must be a positive integer, got {raw!r}")
    if shared + personal > raw:
        raise ValueError(
            f"{where} is {raw}: this run's splat field needs {shared} shared + {personal} "
            f"personal Gaussians (run-config 'splat-count', 'personal-splat-count'); the node "
            "refuses it"
        )


def pin_simulated_threads(context: Context) -> None:
    """A virtual node computes with the CPUs Ray gave it (OMP_NUM_THREADS, which Ray sets per
    actor to its num_cpus), so one seed gives one run whatever else runs on the machine; a
    deployed node, or one run in process without it, keeps torch's setting."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if is_simulated(context) and threads.isdigit() and int(threads) != torch.get_num_threads():
        torch.set_num_threads(max(int(threads), 1))


def node_data_dir(context: Context, prefix: str) -> Path:
    """This node's own data folder: a deployed node's node-config `data-dir` (it refuses
    without one), a virtual node's <run-config data-dir>/<prefix>_NN."""
    if not is_simulated(context):
        if DATA_DIR not in context.node_config:
            raise ValueError(
                f"node {context.node_id}: node-config has no '{DATA_DIR}': a deployed SuperNode "
                f"must be started with --node-config \"{DATA_DIR}='/path'\" (its own folder; "
                "the server's run-config never names it)"
            )
        path = Path(str(context.node_config[DATA_DIR]))
    else:
        root = str(context.run_config.get(DATA_DIR, ""))
        if not root:
            raise ValueError(
                f"node {context.node_id}: no data: a simulation's launcher names the root of "
                f"the {prefix}_NN folders in run-config '{DATA_DIR}'"
            )
        index = client_index(context)
        names = (f"{prefix}_{index:02d}", f"{prefix}_{index:03d}")  # crowds NN, collections NNN
        path = next(
            (Path(root) / n for n in names if (Path(root) / n).is_dir()), Path(root) / names[0]
        )
    if not path.is_dir():
        raise FileNotFoundError(f"node {context.node_id}: data folder {path} does not exist")
    return path


def node_state_dir(context: Context) -> Path | None:
    """This node's state directory: a deployed node's node-config `state-dir`, a virtual
    node's <run-config state-dir>/node_NN; None (Flower's context) without one."""
    if not is_simulated(context):
        return (
            Path(str(context.node_config[STATE_DIR])) if STATE_DIR in context.node_config else None
        )
    root = str(context.run_config.get(STATE_DIR, ""))
    if root:
        return Path(root) / f"node_{client_index(context):02d}"
    return None


VERSION_KEY = "fedfields.state-version"
"""Where a state file holds the (round, attempt) that wrote it: an int64 pair among its
tensors, a two-item list in its JSON; stripped when read."""


Versioned = tuple[Any, tuple[int, int] | None]
"""A state file's content and the (round, attempt) that wrote it (None: unversioned)."""


@dataclass(frozen=True)
class RunAttempt:
    """The round a message belongs to and the run's continuations so far: each entry of
    `resume_points` is the round a continuation started after (`RESUME_POINTS`); the
    attempt is their count (0 before any)."""

    server_round: int
    resume_points: tuple[int, ...] = ()

    @classmethod
    def of_config(cls, server_round: int, config: Mapping[str, Any]) -> RunAttempt:
        """From a message's "server-round" and its "resume-points" entry (absent: none)."""
        text = str(config.get(RESUME_POINTS, ""))
        return cls(server_round, tuple(int(part) for part in text.split(",") if part))

    @property
    def attempt(self) -> int:
        return len(self.resume_points)

    def keeps(self, version: tuple[int, int] | None) -> bool:
        """Whether a state version written in (round, attempt) `version` is one the server's
        checkpoints kept: this attempt's up to this round; an earlier attempt's up to the
        round every later continuation started after (what a killed round wrote is not).
        An unversioned file (written before versions, or in split mode) is kept."""
        if version is None:
            return True
        written_round, written_attempt = version
        if written_attempt == self.attempt:
            return written_round <= self.server_round
        if written_attempt > self.attempt:
            return False
        return written_round <= min(self.resume_points[written_attempt:])


class NodeState:
    """A client's private state, kept on its node: files in its state directory, if it has
    one, else Flower's per-node `context.state` (in memory, simulation only).

    Tensors are saved one dict per name (`<name>.pt`), small values as JSON (`<name>.json`),
    each written atomically so a crash never leaves half a file. Given the message's
    `RunAttempt`, each file also holds the round and attempt that wrote it, and the version
    it replaces from an earlier round stays as `<name>.prev.pt` (`.prev.json`): a node that
    finished a round the server then died in and did not keep reads the version before it
    when the run continues, so a continued run is the run never stopped.
    """

    def __init__(self, context: Context, attempt: RunAttempt | None = None) -> None:
        self.context = context
        self.attempt = attempt
        self.directory = node_state_dir(context)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

    def tensors(self, name: str) -> dict[str, Tensor] | None:
        """The tensor dict saved under `name` (its newest version this run kept), or None;
        ValueError naming the file when it is cut short or damaged (not named tensors)."""
        if self.directory is None:
            record = self.context.state.get(name)
            return arrays_to_state(record) if record is not None else None
        return self._newest_kept(name, "pt", self._read_tensors)

    def put_tensors(self, name: str, tensors: Mapping[str, Tensor]) -> None:
        """Keep `tensors` under `name` (the version this round's attempt wrote)."""
        if self.directory is None:
            self.context.state[name] = state_to_arrays(dict(tensors))
            return
        tensors = {key: value.detach().cpu() for key, value in tensors.items()}
        path = self.directory / f"{name}.pt"
        if self.attempt is not None:
            if path.is_file():
                self._keep_previous(path, self._read_tensors(path, name)[1])
            stamp = (self.attempt.server_round, self.attempt.attempt)
            tensors[VERSION_KEY] = torch.tensor(stamp, dtype=torch.int64)
        atomic.save_torch(path, tensors)

    def values(self, name: str) -> dict[str, Any] | None:
        """The JSON-able dict saved under `name` (its newest version this run kept), or None;
        ValueError naming the file when it is cut short or damaged (not a JSON object)."""
        if self.directory is None:
            record = self.context.state.get(name)
            return json.loads(str(record["json"])) if record is not None else None
        return self._newest_kept(name, "json", self._read_values)

    def put_values(self, name: str, values: Mapping[str, Any]) -> None:
        """Keep the JSON-able `values` under `name` (the version this round's attempt wrote)."""
        values = dict(values)
        if self.directory is None:
            self.context.state[name] = ConfigRecord({"json": json.dumps(values)})
            return
        path = self.directory / f"{name}.json"
        if self.attempt is not None:
            if path.is_file():
                self._keep_previous(path, self._read_values(path, name)[1])
            values[VERSION_KEY] = [self.attempt.server_round, self.attempt.attempt]
        atomic.write_text(path, json.dumps(values))

    def _newest_kept(
        self,
        name: str,
        suffix: str,
        read: Callable[[Path, str], tuple[Any, tuple[int, int] | None]],
    ) -> Any:
        """The content of `name`'s newest version this attempt keeps (all: without one)."""
        for path in self._versions(name, suffix):
            content, version = read(path, name)
            if self.attempt is None or self.attempt.keeps(version):
                return content
        return None

    def _versions(self, name: str, suffix: str) -> list[Path]:
        """`name`'s files, newest first: the current version, then the one before it."""
        assert self.directory is not None
        paths = (self.directory / f"{name}.{suffix}", self.directory / f"{name}.prev.{suffix}")
        return [path for path in paths if path.is_file()]

    def _keep_previous(self, path: Path, version: tuple[int, int] | None) -> None:
        """Before a new version replaces `path`: if it is a version this run kept from an
        earlier round, it becomes `<name>.prev`; one of this round's (a second write) or one a
        killed round left is overwritten, and the `.prev` beside it stays."""
        assert self.attempt is not None
        if not self.attempt.keeps(version):
            return
        if version is not None and version == (self.attempt.server_round, self.attempt.attempt):
            return
        os.replace(path, path.with_name(f"{path.stem}.prev{path.suffix}"))

    @staticmethod
    def _read_tensors(path: Path, name: str) -> tuple[dict[str, Tensor], tuple[int, int] | None]:
        tensors = atomic.load_torch(path, f"node state {name!r}")
        if not isinstance(tensors, dict) or not all(
            isinstance(key, str) and isinstance(value, Tensor) for key, value in tensors.items()
        ):
            raise ValueError(f"{path} is not a readable node state {name!r}: not named tensors")
        stamp = tensors.pop(VERSION_KEY, None)
        if stamp is None:
            return tensors, None
        if stamp.shape != (2,) or stamp.dtype != torch.int64:
            raise ValueError(f"{path} is not a readable node state {name!r}: a bad version stamp")
        return tensors, (int(stamp[0]), int(stamp[1]))

    @staticmethod
    def _read_values(path: Path, name: str) -> tuple[dict[str, Any], tuple[int, int] | None]:
        try:
            values = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path} is not a readable node state {name!r}: {error}") from None
        if not isinstance(values, dict):
            raise ValueError(f"{path} is not a readable node state {name!r}: not a JSON object")
        stamp = values.pop(VERSION_KEY, None)
        if stamp is None:
            return values, None
        if not (
            isinstance(stamp, list) and len(stamp) == 2 and all(isinstance(v, int) for v in stamp)
        ):
            raise ValueError(f"{path} is not a readable node state {name!r}: a bad version stamp")
        return values, (stamp[0], stamp[1])


USER = "user"
"""A deployed node's node-config key naming its user."""


def user_key(context: Context) -> str:
    """This node's user: partition-id in simulation; when deployed, node-config `user`, else
    its `data-dir` folder's name, else partition-id. ValueError when it has none of them."""
    config = context.node_config
    if not is_simulated(context):
        if USER in config:
            return str(config[USER])
        if DATA_DIR in config:
            return Path(str(config[DATA_DIR])).name
    if PARTITION_ID in config:
        return str(config[PARTITION_ID])
    raise ValueError(
        f"node {context.node_id}: node-config names no user: give it '{USER}', "
        f"'{DATA_DIR}' or '{PARTITION_ID}'"
    )


def answer_user_key(msg: Message, context: Context) -> Message:
    """A ClientApp's reply to the server's "query.user_key": this node's `user_key`."""
    content = RecordDict({USER_RECORD: ConfigRecord({USER_KEY: user_key(context)})})
    return Message(content, reply_to=msg)

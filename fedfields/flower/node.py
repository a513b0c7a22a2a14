"""What a SuperNode knows about itself: which client it is, its own data, its private state.

Node-config (a deployed SuperNode's `--node-config`) names everything a node needs:
  partition-id, num-partitions  which client this node is (faces and video pick their data by it)
  data-dir                      this node's own data: a crowd user folder, an object folder, or
                                the split-learning scene
  state-dir                     a node-local directory for the client's private state
In simulation Flower passes only partition-id and num-partitions; the launcher then names a
root in run-config `data-dir` (`state-dir`), and virtual node i takes `<root>/<prefix>_<i:02d>`
or `_<i:03d>` (`<root>/node_<i:02d>`). The run-config roots are never read by the ServerApp.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context
from torch import Tensor

from fedfields import atomic
from fedfields.flower.protocol import arrays_to_state, state_to_arrays

PARTITION_ID = "partition-id"
DATA_DIR = "data-dir"
STATE_DIR = "state-dir"


def client_index(context: Context) -> int:
    """This node's client index: node-config `partition-id` (`user` is the older name)."""
    node_config = context.node_config
    for key in (PARTITION_ID, "user"):
        if key in node_config:
            return int(node_config[key])
    raise ValueError(
        f"node {context.node_id}: node-config needs '{PARTITION_ID}' (which client this node is)"
    )


def node_data_dir(context: Context, prefix: str) -> Path:
    """This node's own data folder: node-config `data-dir`, else run-config root/<prefix>_NN."""
    if DATA_DIR in context.node_config:
        path = Path(str(context.node_config[DATA_DIR]))
    elif "user-dir" in context.node_config:
        path = Path(str(context.node_config["user-dir"]))
    else:
        root = str(context.run_config.get(DATA_DIR, ""))
        if not root:
            raise ValueError(
                f"node {context.node_id}: no data: give the SuperNode --node-config "
                f"\"{DATA_DIR}='/abs/its/own/folder'\" (or, in simulation, run-config "
                f"'{DATA_DIR}' naming the root of the {prefix}_NN folders)"
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
    """This node's state directory: node-config `state-dir`, else run-config root/node_NN."""
    if STATE_DIR in context.node_config:
        return Path(str(context.node_config[STATE_DIR]))
    root = str(context.run_config.get(STATE_DIR, ""))
    if root:
        return Path(root) / f"node_{client_index(context):02d}"
    return None


class NodeState:
    """A client's private state, kept on its node: files in its state directory, if it has
    one, else Flower's per-node `context.state` (in memory, simulation only).

    Tensors are saved one dict per name (`<name>.pt`), small values as JSON (`<name>.json`),
    each written atomically so a crash never leaves half a file.
    """

    def __init__(self, context: Context) -> None:
        self.context = context
        self.directory = node_state_dir(context)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

    def tensors(self, name: str) -> dict[str, Tensor] | None:
        """The tensor dict saved under `name`, or None."""
        if self.directory is None:
            record = self.context.state.get(name)
            return arrays_to_state(record) if record is not None else None
        path = self.directory / f"{name}.pt"
        return torch.load(path, weights_only=True) if path.is_file() else None

    def put_tensors(self, name: str, tensors: Mapping[str, Tensor]) -> None:
        """Keep `tensors` under `name`."""
        if self.directory is None:
            self.context.state[name] = state_to_arrays(dict(tensors))
            return
        tensors = {key: value.detach().cpu() for key, value in tensors.items()}
        atomic.save_torch(self.directory / f"{name}.pt", tensors)

    def values(self, name: str) -> dict[str, Any] | None:
        """The JSON-able dict saved under `name`, or None."""
        if self.directory is None:
            record = self.context.state.get(name)
            return json.loads(str(record["json"])) if record is not None else None
        path = self.directory / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def put_values(self, name: str, values: Mapping[str, Any]) -> None:
        """Keep the JSON-able `values` under `name`."""
        text = json.dumps(dict(values))
        if self.directory is None:
            self.context.state[name] = ConfigRecord({"json": text})
            return
        atomic.write_text(self.directory / f"{name}.json", text)

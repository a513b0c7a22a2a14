"""This app's registry of client halves: run-config mode and task -> the half that answers.

Like `strategies` for the server: a half is one module in `clients/` with its `HALF`
(`clients.client_call.ClientHalf`) and one entry here.
"""

from __future__ import annotations

from clients import meta_client, scene_client, split_client
from clients.client_call import ClientHalf
from fedfields.config import FederatedConfig

HALVES: tuple[ClientHalf, ...] = (scene_client.HALF, meta_client.HALF, split_client.HALF)
REGISTRY: dict[tuple[str, str], ClientHalf] = {
    (half.mode, task): half for half in HALVES for task in half.tasks
}


def client_half(mode: str, task: str) -> ClientHalf:
    """The half registered for run-config `mode` and `task`; one ValueError naming the key and
    value that has none, and the known ones."""
    if (mode, task) in REGISTRY:
        return REGISTRY[(mode, task)]
    modes = sorted({known_mode for known_mode, _ in REGISTRY})
    if mode not in modes:
        raise ValueError(
            f"run-config 'mode' {mode!r} has no client half; known: {', '.join(modes)}"
        )
    tasks = [known_task for known_mode, known_task in REGISTRY if known_mode == mode]
    raise ValueError(
        f"run-config 'task' {task!r} has no client half in mode {mode!r}; known: {', '.join(tasks)}"
    )


def half_for(config: FederatedConfig) -> ClientHalf:
    """The half that answers this run's messages."""
    return client_half(config.common.mode, config.common.task)

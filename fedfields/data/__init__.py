"""Scenes and datasets for federated neural fields."""

from fedfields.data.scene import Scene, SceneError, holdout_indices, load_scene

__all__ = ["Scene", "SceneError", "holdout_indices", "load_scene"]

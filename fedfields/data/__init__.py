"""Scenes and datasets for federated neural fields."""

from fedfields.data.scene import Cameras, Scene, SceneError, holdout_indices, load_scene

__all__ = ["Cameras", "Scene", "SceneError", "holdout_indices", "load_scene"]

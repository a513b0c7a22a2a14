"""Flower ClientApps built on ``fedfields.train``."""

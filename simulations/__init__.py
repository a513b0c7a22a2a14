"""ServerApp entry points, experiment presets and benchmark scripts."""

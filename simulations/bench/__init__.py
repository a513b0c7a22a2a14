"""Benchmark scripts; see docs/BENCHMARKS.md for the commands and latest figures."""

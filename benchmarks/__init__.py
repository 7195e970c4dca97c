"""Benchmarks: run ``python -m benchmarks`` (see run.py)."""

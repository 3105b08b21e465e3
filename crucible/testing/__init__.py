"""Helpers for tests and benchmarks that need a hostile machine: CPU and fsync
stressors (``stress``); never imported by a training process."""

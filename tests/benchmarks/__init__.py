"""Benchmarks: how close the scripts run to the bare compute. Not collected by pytest (see README)."""

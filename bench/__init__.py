"""Workloads, load generation and benchmarks for kvroute (see bench/README.md)."""

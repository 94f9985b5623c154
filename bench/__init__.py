"""Benchmarks (each with a --smoke mode; results in bench/results/)."""

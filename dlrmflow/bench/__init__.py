"""Benchmarks: each prints JSON whose ``ratios`` are ours / a baseline measured in the same run."""

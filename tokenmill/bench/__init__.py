"""Benchmarks run through the public engine API: latency (one user) and throughput (many)."""

"""Measuring cost: the analytic FLOP model, KV-cache bytes, interleaved latency of two models, and the benchmarks of
the α search and of the fast scorer."""

"""Benchmarks a user runs against a server (``trtllm-bench``)."""

"""Workloads kvgate replays: trace loading (Mooncake JSONL) and synthetic generators."""

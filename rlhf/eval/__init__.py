"""Benchmark evaluation (`rlhf eval`): tasks in the benchmarks' own layouts, scored on the rollout engine."""

"""Checkpoint tools: HF <-> megatron-core conversion (`rlhf convert`)."""

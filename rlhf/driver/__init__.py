"""The single controller: workflow API, built-in GRPO / PPO / SFT / pretrain loops, checkpoints, monitoring."""

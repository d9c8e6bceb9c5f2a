"""The single controller, one subpackage per concern: `infra` (run infrastructure), `rl` (the RL stage),
`stages` (pretraining, SFT, DPO, reward model) and `warmstart` (inputs made ready and the SFT warm start)."""

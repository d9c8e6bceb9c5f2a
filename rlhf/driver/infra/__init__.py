"""Run infrastructure every stage shares: the run scaffold, Ray start-up and clean-up, preemption, the run folder, metrics, reports and run checkpoints."""

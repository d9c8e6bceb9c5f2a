"""Run infrastructure every stage shares: the run scaffold, the run loop, Ray start-up and clean-up, preemption, the run folder, metrics, reports and run checkpoints."""

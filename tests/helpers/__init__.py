"""Shared helpers for the tests, never a test module: pytest collects nothing here.

Test modules (tests/**/test_*.py and conftest.py) import what they share from these modules, never from one
another (tests/test_test_layout.py checks it). One module a purpose:

- cli: the `rlhf` subprocess runner, its environment and the fast RL overrides (FAST)
- runs: a run folder's metrics and checkpoints, and waiting on a running `rlhf train` (wait_for, HANG_S)
- net: the listening sockets of a process tree, and those beyond loopback
- lm: fast overrides for the LM stage runs (SFT, pretraining)
- files: JSON-lines writers
- batches: RL batches in the driver's layout, LM batches, HF reference log-probs, micro-batch counts
- layouts: worker groups of several layouts on one local Ray, and their weights
- hf: HF folder comparisons and the conversion tests' per-rank checks
- procs: processes found by a marker in their command line, polling, an interpreter any uid can run
- planted: a hostile pickle, and checkpoint folders that carry one
- references: plain-Python loop references of the algorithms
- sync_faults: weight-sync faults injected through transports (the per-sync digest's fault tests)
"""

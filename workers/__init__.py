"""The Ray actors, the Megatron engine and the rollout engines. Importing the package installs the import hooks
of workers/lean_imports.py in this process (scikit-learn out of transformers' generation utilities; without
CUDA, no Inductor for megatron-core's fusions; no wandb for its inference engine)."""

from workers.lean_imports import install_lean_imports

install_lean_imports()

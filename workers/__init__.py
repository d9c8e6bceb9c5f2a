"""The Ray actors, the Megatron engine and the rollout engines. Importing the package keeps scikit-learn out of
transformers' generation utilities in this process (workers/lean_imports.py says why)."""

from workers.lean_imports import skip_sklearn_in_transformers

skip_sklearn_in_transformers()

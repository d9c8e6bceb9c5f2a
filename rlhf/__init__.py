"""The driver, config, CLI, data and tools. Importing it imports `workers`, which keeps scikit-learn out of
transformers' generation utilities in this process (workers/lean_imports.py)."""

import workers  # noqa: F401

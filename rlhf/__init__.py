"""The driver, config, CLI, data and tools. Importing it imports `workers`, which installs the import hooks of
workers/lean_imports.py in this process."""

import workers  # noqa: F401

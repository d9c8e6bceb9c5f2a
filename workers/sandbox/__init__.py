"""A sandbox for untrusted code: model-written programs, code-execution rewards and the `python` tool."""

from workers.sandbox.sandbox import SandboxLimits, SandboxResult, namespaces_available, run_code, run_many

__all__ = ["SandboxLimits", "SandboxResult", "namespaces_available", "run_code", "run_many"]

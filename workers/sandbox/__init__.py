"""A sandbox for untrusted code: model-written programs, code-execution rewards and the `python` tool."""

from workers.sandbox.sandbox import SandboxLimits, SandboxResult, namespaces_available, run_code, run_many
from workers.sandbox.verdict import CheckResult, CodeCheck, run_check, run_checks

__all__ = ["CheckResult", "CodeCheck", "SandboxLimits", "SandboxResult", "namespaces_available", "run_check",
           "run_checks", "run_code", "run_many"]

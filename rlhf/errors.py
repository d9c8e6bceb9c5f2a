"""User-facing errors: raised for bad config or input, printed without a traceback by the CLI."""


class UserError(Exception):
    """Bad input from the user (config, file, flag). The message names the field or file and what was expected."""


class ConfigError(UserError):
    """A config value is missing, unknown, of the wrong type, or inconsistent with another."""


class NonFiniteError(UserError):
    """Too many optimizer steps in a row had a NaN/Inf gradient norm (policy.optim.max_consecutive_nonfinite)."""


class Stopped(Exception):
    """The run stopped on SIGTERM / SIGINT; `exit_code` is 128 + the signal (143, 130)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code

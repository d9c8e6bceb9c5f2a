"""User-facing errors: raised for bad config or input, printed without a traceback by the CLI."""


class UserError(Exception):
    """Bad input from the user (config, file, flag). The message names the field or file and what was expected."""


class ConfigError(UserError):
    """A config value is missing, unknown, of the wrong type, or inconsistent with another."""

"""The config's error type (its own module so that every section can raise it)."""

from sparserl.errors import UserError


class ConfigError(UserError):
    """A config file or override that does not fit TrainConfig; the message names the culprit."""

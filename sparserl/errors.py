"""The one base class of errors caused by what the user gave (a config, a data file, a model path).

The CLI prints such an error as one line naming the culprit and exits non-zero; anything else is a bug and
keeps its traceback. Library code raises a subclass (ConfigError, ModelLoadError, DataError, ...) with a
message that says what is wrong, where (file:line, config key, model name) and what to do.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input from the user; the message alone explains it (no traceback needed)."""


class DataError(UserError):
    """A data file or dataset row that cannot be used (the message names the file and line)."""


class ClusterError(UserError, RuntimeError):
    """Ray cannot be reached, or cannot place the actors the run asks for (the message names the setting and
    what the cluster has)."""

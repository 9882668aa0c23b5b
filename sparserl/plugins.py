"""Importing users' modules by name, like `python -m` (sys.path, then the working directory): the modules of the
`plugins` config key, whose registrations (a group source, a loss, a KV method, a task, ...) must exist before
the config checks the names it selects, and the modules of 'module:function' reward specs."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable
from types import ModuleType

from sparserl.errors import UserError


def import_user_module(module_name: str, what: str) -> ModuleType:
    """The module `module_name`; a UserError starting with `what` (the setting that names it) when it cannot
    be imported or exits while importing."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.append(cwd)
    try:
        return importlib.import_module(module_name)
    except SystemExit as e:
        raise UserError(f"{what}: importing module {module_name!r} called sys.exit({e.code!r})") from None
    except Exception as e:
        raise UserError(f"{what}: cannot import module {module_name!r}: {type(e).__name__}: {e}") from e


def import_plugins(names: Iterable[str]) -> None:
    """Import each module of the `plugins` config key, in order (an already imported one is not run again)."""
    for name in names:
        import_user_module(name, f"plugins={name!r}")

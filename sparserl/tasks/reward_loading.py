"""Loading users' reward functions by name: 'module:function' (dotted attributes allowed, like `python -m`, the
working directory searched too) or 'path/to/file.py:function' (imported once per file under a name of its own).
A spec that cannot be imported, found or called is a UserError naming it; calling them is `reward_fns`'.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sparserl.errors import UserError
from sparserl.plugins import import_user_module
from sparserl.tasks.config import BUILTIN_REWARD

RewardFn = Callable[..., Sequence[Any]]


def check_spec(spec: str) -> None:
    """Raise the usual UserError for a spec that is not 'module:function' / 'file.py:function'."""
    location, sep, attr = spec.rpartition(":")
    if not sep or not location or not attr:
        raise UserError(
            f"task.reward={spec!r} must be 'module:function', 'path/to/file.py:function' or '{BUILTIN_REWARD}'"
        )


def _import_file(path: Path, spec: str) -> Any:
    """The module in the Python file `path`, imported once per file."""
    if not path.is_file():
        raise UserError(f"task.reward={spec!r}: no such file {path}")
    resolved = path.resolve()
    name = f"sparserl_reward_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise UserError(f"task.reward={spec!r}: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except SystemExit as e:
        del sys.modules[name]
        raise UserError(f"task.reward={spec!r}: importing {path} called sys.exit({e.code!r})") from None
    except Exception as e:
        del sys.modules[name]
        raise UserError(f"task.reward={spec!r}: importing {path} failed: {type(e).__name__}: {e}") from e
    return module


def load_reward_function(spec: str) -> RewardFn:
    """The callable named by 'module:function' (dotted attributes allowed, 'module:Class.method') or
    'path/to/file.py:function'. Raises UserError naming the spec when it cannot be found or called."""
    check_spec(spec)
    location, _, attr = spec.rpartition(":")
    is_file = location.endswith(".py") or "/" in location or os.sep in location
    module = (
        _import_file(Path(location), spec)
        if is_file
        else import_user_module(location, f"task.reward={spec!r}")
    )
    value: Any = module
    for part in attr.split("."):
        if not hasattr(value, part):
            defined = sorted(
                n
                for n, v in vars(module).items()
                if callable(v) and getattr(v, "__module__", None) == module.__name__
            )
            raise UserError(
                f"task.reward={spec!r}: {location} has no function {attr!r} "
                f"(it defines: {', '.join(defined) or 'no functions'})"
            )
        value = getattr(value, part)
    if not callable(value):
        raise UserError(f"task.reward={spec!r}: {attr} is a {type(value).__name__}, not a function")
    return value

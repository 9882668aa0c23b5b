"""Config values coerced to their field's type: YAML values and `key=value` strings alike, with an error
naming the key when a value does not fit (integers beyond int64 included)."""

from __future__ import annotations

import math
import types
import typing
from typing import Any

import yaml

from sparserl.config.errors import ConfigError


def field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def is_optional(tp: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return True, args[0]
    return False, tp


INT64_MAX = 2**63 - 1


def _in_int64(number: int, value: Any, key: str) -> int:
    """`number` if a 64-bit integer holds it (torch and numpy take no more); else a ConfigError naming `key`."""
    if not -INT64_MAX - 1 <= number <= INT64_MAX:
        raise ConfigError(f"{key}={value!r} is out of range: integers here are at most {INT64_MAX:,}")
    return number


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def _list_text(text: str, of_strings: bool, bad: ConfigError) -> Any:
    """A command-line list: YAML's `[a, b]` (a list of strings YAML cannot read, such as `[builtin, :f]`, split
    on commas: each item's own check then names the one at fault) or plain `a,b`."""
    if not text.startswith("["):
        return [v.strip() for v in text.split(",") if v.strip()]
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        if not of_strings or not text.endswith("]"):
            raise bad from None
        return [v.strip() for v in text[1:-1].split(",") if v.strip()]


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert `value` (typed YAML, or a command-line string) to the field type `tp`, or raise ConfigError."""
    optional, inner = is_optional(tp)
    if optional:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none", "~")):
            return None
        return coerce(value, inner, key)
    bad = ConfigError(f"{key}={value!r} is not a valid {type_name(tp)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise bad
    if tp is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return _in_int64(value, value, key)
        if isinstance(value, float) and value.is_integer():
            return _in_int64(int(value), value, key)
        if isinstance(value, str):
            try:
                number = int(value.strip().replace("_", ""))
            except ValueError:
                try:
                    f = float(value)
                except ValueError:
                    raise bad from None
                if not f.is_integer():
                    raise bad from None
                number = int(f)
            return _in_int64(number, value, key)
        raise bad
    if tp is float:
        if isinstance(value, bool):
            raise bad
        try:
            number = float(value.strip() if isinstance(value, str) else value)
        except (TypeError, ValueError):
            raise bad from None
        if math.isnan(number):  # no setting means anything with NaN; it would pass every `<` check silently
            raise ConfigError(f"{key}={value!r} is not a number")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):
            value = _list_text(value.strip(), item_tp is str, bad)
        if not isinstance(value, (list, tuple)):
            raise bad
        return [coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        k_tp, v_tp = typing.get_args(tp) or (Any, Any)
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                raise bad from None
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise bad
        return {coerce(k, k_tp, key): coerce(v, v_tp, f"{key}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    raise ConfigError(f"{key}: fields of type {type_name(tp)} are not supported by the config loader")

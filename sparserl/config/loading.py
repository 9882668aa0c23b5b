"""Reading a config: YAML file + `key.sub=value` overrides -> TrainConfig, strictly. An unknown key is an error
listing the valid keys; a value that does not fit the field's type is an error naming the key (and the file and
line when it came from YAML). Also writing it back, and the help text of every field."""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from sparserl.algo.config import canonical_keys
from sparserl.algo.presets import merge_presets, preset_names
from sparserl.config.sections import (
    CONFIG_DIR,
    DEFAULT_PRESET,
    AlgoSection,
    ConfigError,
    TrainConfig,
)
from sparserl.config.values import coerce, field_types, is_optional, type_name
from sparserl.errors import UserError
from sparserl.plugins import import_plugins
from sparserl.tasks import TaskConfig

# ------------------------------------------------------------------------------------------------ building


class _Where:
    """Where each key path came from (file:line, or 'command line'), for error messages."""

    def __init__(self) -> None:
        self.places: dict[str, str] = {}

    def __call__(self, key: str) -> str:
        place = self.places.get(key)
        return f"{place}: " if place else ""


def _unknown_key_error(key: str, valid: list[str], where: str) -> ConfigError:
    name = key.rsplit(".", 1)[-1]
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    scope = f"under '{parent}'" if parent else "at the top level"
    return ConfigError(f"{where}unknown config key '{key}'{hint}; valid keys {scope}: {', '.join(valid)}")


def _build(cls: type, data: Any, prefix: str, where: _Where) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where(prefix)}'{prefix}' must be a mapping of keys to values, got {data!r}")
    if cls is AlgoSection:  # TRL's key names for verl's (algo/config.py KEY_ALIASES)
        try:
            data = canonical_keys(data)
        except ValueError as e:
            raise ConfigError(f"{where(prefix)}{e}") from None
    hints = field_types(cls)
    valid = [f.name for f in fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in valid:
            raise _unknown_key_error(path, valid, where(path))
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            continue
        if isinstance(value, dict) and typing.get_origin(is_optional(tp)[1]) is not dict:
            raise ConfigError(
                f"{where(path)}'{path}' is not a section: it takes one {type_name(tp)} value (e.g. {path}=...)"
            )
        try:
            kwargs[key] = coerce(value, tp, path)
        except ConfigError as e:
            raise ConfigError(f"{where(path)}{e}") from None
    for key in valid:
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            path = f"{prefix}.{key}" if prefix else key
            section = data.get(key) or {}
            if not isinstance(section, dict):
                raise ConfigError(
                    f"{where(path)}'{path}' must be a mapping of keys to values, got {section!r}"
                )
            f = next(f for f in fields(cls) if f.name == key)
            if tp is not AlgoSection and f.default_factory is not dataclasses.MISSING:
                # start from this config's default for the section (e.g. kv defaults to R-KV), then override
                base = f.default_factory()
                if tp is TaskConfig and section.get("data") and "name" not in section:
                    section = {**section, "name": section["data"]}  # a data path selects the dataset task
                if tp is TaskConfig and section.get("name", base.name) != base.name:
                    base = (
                        TaskConfig()
                    )  # another task: the default run's arithmetic prompt does not carry over
                defaults = {g.name: getattr(base, g.name) for g in fields(base)}
                defaults = {
                    k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
                    for k, v in defaults.items()
                }
                section = {**defaults, **section}
            else:
                section = dict(section)
            if cls is TrainConfig and key == "rollout" and "source" in section:
                # rollout.source became sampling.method (configs saved before the sampling section)
                sampling = {"method": section.pop("source"), **(data.get("sampling") or {})}
                data = {**data, "sampling": sampling}
            if cls is TrainConfig and key == "distill":
                _drop_distill_v1(section, where)
            # algo.group_size was always rollout.n (configs saved before group ids carry it): read and dropped
            if (
                cls is TrainConfig
                and key == "algo"
                and str(section.pop("group_size", kwargs["rollout"].n)) != str(kwargs["rollout"].n)
            ):
                raise ConfigError(
                    f"{where('algo.group_size')}algo.group_size is gone: advantages are taken over each "
                    "sample's group id, so groups may have any size; set rollout.n (samples per prompt)"
                )
            kwargs[key] = _build(tp, section, path, where)
    if cls is AlgoSection:
        preset = kwargs.pop("preset", DEFAULT_PRESET)
        try:
            preset_names(preset)
        except ValueError as e:
            key = f"{prefix}.preset"
            raise ConfigError(f"{where(key)}{key}={e}") from None
        return _construct(lambda: AlgoSection.from_preset(preset, **kwargs), prefix, where)
    return _construct(lambda: cls(**kwargs), prefix, where)


def _drop_distill_v1(section: dict, where: _Where) -> None:
    """distill.lr_scale and distill.kl_coef were DistillSparse v1's (PPO with the policy's advantages plus a KL):
    configs saved then still carry them. Dropped when DistillSparse was off; refused when it was on, since v2
    optimises another objective and its adapter cannot continue v1's."""
    retired = [k for k in ("lr_scale", "kl_coef") if section.pop(k, None) is not None]
    if retired and str(section.get("enable", False)).lower() == "true":
        keys = ", ".join(f"distill.{k}" for k in retired)
        raise ConfigError(
            f"{where('distill.' + retired[0])}{keys}: DistillSparse v1's settings (PPO with the policy's "
            "advantages) are gone; v2 distils the dense policy into the sparse path with distill.lr, "
            "distill.divergence and distill.tail_weight (docs/distill.md). Remove them; a run trained with v1 "
            "cannot be resumed with DistillSparse on"
        )


def _construct(make: Any, prefix: str, where: _Where) -> Any:
    try:
        return make()
    except ConfigError as e:
        raise ConfigError(f"{where(prefix)}{e}") from None
    except (ValueError, TypeError) as e:
        label = f"'{prefix}'" if prefix else "config"
        raise ConfigError(f"{where(prefix)}invalid {label}: {e}") from None


def config_from_dict(data: dict[str, Any], where: _Where | None = None) -> TrainConfig:
    """Build a TrainConfig from a nested dict (missing keys keep their defaults; algo.preset applies first).
    The `plugins` modules are imported first: the names they register are then valid in every section."""
    where = where or _Where()
    if data.get("plugins") is not None:
        try:
            import_plugins(coerce(data["plugins"], list[str], "plugins"))
        except UserError as e:
            raise ConfigError(f"{where('plugins')}{e}") from None
    return _build(TrainConfig, data, "", where)


def _yaml_lines(text: str, source: str, where: _Where) -> None:
    """Record file:line for every key path of a YAML document."""

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = f"{prefix}.{k.value}" if prefix else str(k.value)
                where.places[key] = f"{source}:{k.start_mark.line + 1}"
                walk(v, key)

    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return
    if root is not None:
        walk(root, "")


def _is_local_file(value: str) -> bool:
    """A data file or a schedule file (not a Hugging Face dataset name, not an inline table)."""
    from sparserl.tasks.dataset import is_local_source

    return is_local_source(value) or value.lower().endswith((".yaml", ".yml"))


PATH_KEYS = (("task", "data"), ("trainer", "eval_data"), ("kv", "schedule"))


def _resolve_data_paths(data: dict[str, Any], config_file: Path) -> None:
    """Make relative local file paths of a YAML file (data, eval data, a KV schedule file) relative to that
    file, not to the working directory, so a config (and the presets in configs/) works from anywhere. Hugging
    Face dataset names and inline schedules are left alone."""
    for section, key in PATH_KEYS:
        value = (data.get(section) or {}).get(key) if isinstance(data.get(section), dict) else None
        if isinstance(value, str) and value and _is_local_file(value) and not os.path.isabs(value):
            data[section][key] = os.path.normpath(config_file.resolve().parent / os.path.expanduser(value))


def _absolute(value: str) -> str:
    """`value` (a path) made absolute against the working directory."""
    return os.path.normpath(os.path.abspath(os.path.expanduser(value)))


def _resolve_reward_paths(value: Any) -> Any:
    """task.reward with every 'path/to/file.py:function' entry's file made absolute (module names, 'builtin'
    and anything malformed are left for the field's own check)."""
    if isinstance(value, str):
        try:
            value = coerce(value, list[str], "task.reward")
        except ConfigError:
            return value
    if not isinstance(value, list):
        return value
    out = []
    for spec in value:
        if isinstance(spec, str) and ":" in spec:
            location, function = spec.rsplit(":", 1)
            is_file = location.endswith(".py") or "/" in location or os.sep in location
            if location and is_file and not os.path.isabs(location):
                spec = f"{_absolute(location)}:{function}"
        out.append(spec)
    return out


def _resolve_working_dir_paths(data: dict[str, Any]) -> None:
    """Make the relative local paths still left (from the command line, or task.name / task.reward files of a
    YAML file) absolute against the working directory, where they are read now: RUN_DIR/config.yaml then
    names the same files from any directory, so a run resumes (and `sparserl eval RUN_DIR` reads its data)
    wherever it is started. Hugging Face names, built-in tasks, module names and inline tables are left alone."""
    from sparserl.tasks.config import BUILTIN_TASKS
    from sparserl.tasks.dataset import is_local_source

    for section, key in PATH_KEYS:
        node = data.get(section)
        value = node.get(key) if isinstance(node, dict) else None
        if isinstance(value, str) and value.strip() and _is_local_file(value) and not os.path.isabs(value):
            node[key] = _absolute(value)  # type: ignore[index]
    task = data.get("task")
    if not isinstance(task, dict):
        return
    name = task.get("name")
    if (
        isinstance(name, str)
        and name.strip()
        and name not in BUILTIN_TASKS
        and is_local_source(name)
        and not os.path.isabs(name)
    ):
        task["name"] = _absolute(name)
    if task.get("reward") is not None:
        task["reward"] = _resolve_reward_paths(task["reward"])


def resolve_config_path(name: str | Path) -> Path:
    """A YAML path, or the name of a run preset in configs/ ('default' -> configs/default.yaml)."""
    path = Path(name)
    if path.is_file():
        return path
    for candidate in (CONFIG_DIR / f"{name}.yaml", CONFIG_DIR / str(name)):
        if candidate.is_file():
            return candidate
    presets = ", ".join(list_run_presets()) or "(none found)"
    raise ConfigError(
        f"config {str(name)!r} is neither a file nor a run preset in {CONFIG_DIR}; presets: {presets}"
    )


def list_run_presets() -> list[str]:
    """Names of the YAML run presets shipped in configs/."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.is_dir() else []


def parse_override(text: str) -> tuple[list[str], str]:
    """'optim.lr=1e-5' -> (['optim', 'lr'], '1e-5')."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value (e.g. optim.lr=1e-5)")
    key, value = text.split("=", 1)
    parts = [p for p in key.strip().split(".")]
    if not key.strip() or any(not p for p in parts):
        raise ConfigError(f"override {text!r}: the key {key!r} is malformed (expected section.key=value)")
    return parts, value


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> TrainConfig:
    """Read a YAML config (None: the embedded default), apply `key.sub=value` overrides, check everything."""
    where = _Where()
    data: dict[str, Any] = {}
    if path is not None:
        path = resolve_config_path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"{path}: not UTF-8 text (byte {e.start}: {e.object[e.start : e.start + 1]!r})"
            ) from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections (model, task, ...)")
        data = loaded
        _yaml_lines(text, str(path), where)
        _resolve_data_paths(data, path)
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: '{'.'.join(parts[: i + 1])}' is not a section")
            node = child
        if parts == ["algo", "preset"]:  # a loss preset keeps the file's rollout preset (and vice versa)
            value = _merged_preset(node.get("preset", DEFAULT_PRESET), value)
        node[parts[-1]] = value
        where.places[".".join(parts)] = f"command line '{text}'"
    _resolve_working_dir_paths(data)
    return config_from_dict(data, where)


def _merged_preset(old: Any, new: str) -> str:
    """algo.preset=`new` from the command line over the config's `old`: only the kinds of preset it names (a
    preset that is not valid is left for the algo section's check, which names it)."""
    try:
        return merge_presets(str(old), new)
    except ValueError:
        return new


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    """Write `cfg` as YAML that `load_config` reads back into an equal config."""
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


# ------------------------------------------------------------------------------------------------ help


def iter_fields(cls: type = TrainConfig, prefix: str = "") -> typing.Iterator[tuple[str, str, str]]:
    """(key path, type name, help) for every leaf field, in declaration order."""
    hints = field_types(cls)
    for f in fields(cls):
        tp = hints[f.name]
        path = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(tp):
            yield from iter_fields(tp, path)
        else:
            yield path, type_name(tp), f.metadata.get("help", "")


def format_help() -> str:
    """Every config key with its type, default and help, grouped by section."""
    lines: list[str] = []
    section = None
    default = TrainConfig()
    for path, tp, help_text in iter_fields():
        head = path.split(".", 1)[0]
        if head != section:
            section = head
            sec_help = next(f for f in fields(TrainConfig) if f.name == head).metadata.get("help", "")
            lines.append(f"\n{head}: {sec_help}")
        value = default
        for part in path.split("."):
            value = getattr(value, part)
        lines.append(f"  {path} ({tp}, default {value!r})\n      {help_text}")
    return "\n".join(lines)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}: a nested config dict keyed by dotted paths."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out

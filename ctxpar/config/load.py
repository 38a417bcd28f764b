"""A Config from YAML or a plain dict, and back: each value checked against its field's
annotation, ``section.key=value`` overrides applied, then ``validate``; ``to_dict`` and
``dump_config`` write a Config out again."""
from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import os
import typing
from typing import Any, Dict, List, Optional, Sequence, Union

import yaml

from .sections import RENAMED_KEYS, Config, ConfigError, ModelConfig
from .validation import validate

log = logging.getLogger(__name__)


def _coerce(value: Any, tp: Any, key: str, src: str) -> Any:
    """Check a YAML value against a field's annotation; return it (ints widen to float)."""
    origin = typing.get_origin(tp)
    if origin is Union:
        errors = []
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(value, arg, key, src)
            except ConfigError as e:
                errors.append(e)
        raise errors[0] if errors else ConfigError(f"{src}: {key}={value!r} must be set")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{src}: {key} must be a mapping, got {value!r}")
        return _build(tp, value, key, src)
    if tp is Any:
        return value
    if origin in (list, List):
        if not isinstance(value, list):
            raise ConfigError(f"{src}: {key} must be a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, f"{key}[{i}]", src) for i, v in enumerate(value)]
    if origin in (dict, Dict) or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{src}: {key} must be a mapping, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool):
            pass
        elif isinstance(value, (int, float)):
            return float(value)
        elif isinstance(value, str):  # YAML reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{src}: {key}={value!r} must be a number")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{src}: {key}={value!r} must be an integer")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{src}: {key}={value!r} must be true or false")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{src}: {key}={value!r} must be a string")
    raise AssertionError(f"unhandled annotation {tp} for {key}")  # a new field type


def _build(cls, data: Dict[str, Any], prefix: str, src: str):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {(prefix + '.' if prefix else '') + close[0]!r}?)" if close else ""
            raise ConfigError(f"{src}: unknown config key {full!r}{hint}; "
                              f"known keys: {', '.join(fields)}")
        kwargs[key] = _coerce(value, hints[key], full, src)
    return cls(**kwargs)


def model_section(data: Dict[str, Any], src: str):
    """A ModelConfig from a plain dict of model.* (a checkpoint's manifest): its sections
    (model.moe, model.mla) built as load_config builds them, an unknown key refused."""
    return _build(ModelConfig, data, "model", src)


def _parse_override(item: str, src: str):
    if "=" not in item:
        raise ConfigError(f"{src}: override {item!r} must look like section.key=value")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def _apply_override(data: Dict[str, Any], path: List[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {'.'.join(path)}: {part!r} is not a section")
    node[path[-1]] = value


def _deprecated(src: str, renamed: Dict[str, str]) -> None:
    """One notice line naming each old key used and its new spelling (rank 0 only: every
    rank loads the config)."""
    if renamed and os.environ.get("RANK", "0") == "0":
        log.warning("%s: deprecated config keys, still read: %s", src,
                    ", ".join(f"{old} -> {new}" for old, new in renamed.items()))


def _upgrade_old_keys(data: Dict[str, Any], src: str) -> None:
    """Move the keys of renamed sections (RENAMED_KEYS) to their new places, in place."""
    renamed = {}
    for section in sorted({old.split(".")[0] for old in RENAMED_KEYS}):
        if not isinstance(data.get(section), dict):
            continue
        for key, value in data.pop(section).items():
            old = f"{section}.{key}"
            if old not in RENAMED_KEYS:
                moved = ", ".join(new for k, new in RENAMED_KEYS.items()
                                  if k.startswith(section + "."))
                raise ConfigError(f"{src}: unknown config key {old!r} (the deprecated "
                                  f"section {section!r} became {moved})")
            new = renamed[old] = RENAMED_KEYS[old]
            new_section, new_key = new.split(".")
            target = data.setdefault(new_section, {})
            if not isinstance(target, dict) or new_key in target:
                raise ConfigError(f"{src}: {old} and {new} are both set (one key, its old "
                                  f"and its new spelling): keep {new}")
            target[new_key] = value
    _deprecated(src, renamed)


def config_from_dict(data: Dict[str, Any], source: str = "<dict>",
                     overrides: Sequence[str] = (), world_size: Optional[int] = None,
                     check_paths: bool = True, training: bool = True) -> Config:
    """Build, override and validate a Config from a plain dict (what YAML gives)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    data = copy.deepcopy(data)
    _upgrade_old_keys(data, source)
    renamed = {}
    for item in overrides:
        path, value = _parse_override(item, source)
        key = ".".join(path)
        if key in RENAMED_KEYS:
            renamed[key] = RENAMED_KEYS[key]
            key = RENAMED_KEYS[key]
        _apply_override(data, key.split("."), value)
    _deprecated(f"{source}: --set", renamed)
    cfg = _build(Config, data, "", source)
    cfg.source = source
    validate(cfg, world_size, check_paths, training)
    return cfg


def load_config(path: str, overrides: Sequence[str] = (), world_size: Optional[int] = None,
                check_paths: bool = True, training: bool = True) -> Config:
    """Read a YAML file, apply ``section.key=value`` overrides and validate."""
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: config file does not exist")
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"{path}: malformed YAML{where}: {getattr(e, 'problem', e)}") from None
    return config_from_dict(data, source=path, overrides=overrides, world_size=world_size,
                            check_paths=check_paths, training=training)


def to_dict(cfg: Config) -> Dict[str, Any]:
    """Plain nested dict (for dumping and wandb), without the internal fields."""
    out = dataclasses.asdict(cfg)
    out.pop("source", None)
    return out


def dump_config(cfg: Config, run_dir: str) -> str:
    """Write the config used for a run to <run_dir>/config.yaml; returns the path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.yaml")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    os.replace(tmp, path)
    return path

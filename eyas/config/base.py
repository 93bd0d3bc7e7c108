"""Typed configuration: dataclasses with one docstring per field, YAML < `--section.key=value`.

Every stage's settings are a dataclass whose fields carry a docstring (the string literal right
below the field). `from_dict` builds one from plain data with type checks; unknown keys are an
error naming the closest valid key; `__post_init__` of each dataclass validates values, so a bad
config fails before any model is loaded.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from eyas.errors import ConfigError, redact_urls


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its docstring (the string literal that follows the field in the class body)."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(src).body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


RENAMED = {"train.layer_ids": "extract.layer_ids (one key for the aux layers of extraction and online training)"}
"""Keys that moved: an override of the old name is refused naming the new one."""


def _closest(name: str, options: list[str], prefix: str = "") -> str:
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.0)
    return f"; did you mean '{prefix + '.' if prefix else ''}{match[0]}'?" if match else ""


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check/convert one value against a field's annotated type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, prefix=where)
    if origin in (list, tuple):
        if isinstance(value, str):
            try:
                value = safe_load(value)
            except yaml.YAMLError as e:
                raise ConfigError(f"{where}: {e}") from None
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item = args[0] if args else Any
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(float(value)) if float(value).is_integer() else int(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        number = None
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)  # YAML 1.1 reads "1e-4" as a string
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        # no knob means anything at inf or nan (0 is the "none" of budgets): refused here, naming the key,
        # rather than as a nan loss steps into training
        require(math.isfinite(number), f"{where}={value}: expected a finite number")
        return number
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from `data`; unknown keys name the closest valid one."""
    if data is None:
        data = {}
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            if where in RENAMED:
                raise ConfigError(f"config key '{where}' is now {RENAMED[where]}")
            raise ConfigError(f"unknown config key '{where}'{_closest(str(key), names, prefix)}")
        kwargs[key] = _coerce(value, hints[key], where)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{prefix + ': ' if prefix else ''}{e}") from None


def to_dict(obj: Any, secrets: bool = False) -> Any:
    """Dataclass -> plain dict (recursively), URL passwords shown as *** (eyas.errors.redact_urls)
    unless `secrets` (a config handed to a child process, never to a file that stays)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name), secrets) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v, secrets) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v, secrets) for k, v in obj.items()}
    if isinstance(obj, str) and not secrets:
        return redact_urls(obj)
    return obj


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """['--a.b=1', '--c', 'x'] -> {'a': {'b': 1}, 'c': 'x'} (values parsed as YAML scalars/lists)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"expected an override of the form --section.key=value, got {arg!r}")
        body = arg[2:]
        if "=" in body:
            key, raw = body.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, raw = body, args[i + 1]
            i += 1
        else:
            key, raw = body, "true"
        i += 1
        try:
            value = safe_load(raw) if raw != "" else ""
        except AliasBomb as e:
            raise ConfigError(f"--{key}: {e}") from None
        except yaml.YAMLError:
            value = raw
        if value is None:
            value = raw  # "--x=null"-style strings stay strings; fields that allow None accept ""
        node = out
        parts = key.replace("-", "_").split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override --{key} conflicts with another override")
        node[parts[-1]] = value
    return out


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


MAX_YAML_VALUES = 100_000
"""Values a YAML text may hold once its aliases are expanded: a config holds a few hundred; nested
aliases (`b: [*a, *a, ...]`, a "billion laughs") multiply and would hang whatever walks the data."""


class AliasBomb(yaml.YAMLError):
    """A YAML text whose aliases expand past MAX_YAML_VALUES values."""


class BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that counts each composed document's values with its aliases expanded and
    refuses it past MAX_YAML_VALUES (aliases and merge keys stay usable at a config's size)."""

    def compose_document(self):
        node = super().compose_document()
        _expanded_size(node, {}, set())
        return node


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_: set[int]) -> int:
    """Values under `node` with every alias expanded; each node is counted once (`sizes`), so this is
    as fast as the text is long."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_:
        raise AliasBomb(f"an alias refers to a value that holds it (line {node.start_mark.line + 1})")
    open_.add(id(node))
    children = node.value if isinstance(node, yaml.SequenceNode) else \
        [n for kv in node.value for n in kv] if isinstance(node, yaml.MappingNode) else []
    size = 1 + sum(_expanded_size(child, sizes, open_) for child in children)
    open_.discard(id(node))
    if size > MAX_YAML_VALUES:
        raise AliasBomb(f"its aliases (*name) expand the value at line {node.start_mark.line + 1} to more than "
                        f"{MAX_YAML_VALUES:,} values; write the values out instead of nesting aliases")
    sizes[id(node)] = size
    return size


def safe_load(text: str) -> Any:
    """yaml.safe_load, with aliases bounded (BoundedLoader)."""
    return yaml.load(text, Loader=BoundedLoader)


class _UniqueKeyLoader(BoundedLoader):
    """BoundedLoader (aliases bounded) that also refuses a key written twice in one mapping (YAML
    keeps the last one, so a second `train:` section would silently replace the first). Checked on
    the text as written, before merges: keys a `<<: *anchor` merge brings in may be set again,
    overriding them is what a merge is for."""

    def compose_document(self):
        node = super().compose_document()
        _refuse_duplicate_keys(node, set())
        return node


def _refuse_duplicate_keys(node: yaml.Node, seen_nodes: set[int]) -> None:
    if id(node) in seen_nodes:  # an alias: its node was checked where it was written
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, str], yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            was = first.setdefault((key_node.tag, key_node.value), key_node)
            if was is not key_node:
                where = key_node.start_mark.name
                raise ConfigError(f"{where}:{was.start_mark.line + 1} and {where}:{key_node.start_mark.line + 1} both "
                                  f"set {key_node.value!r}: YAML would keep only the second; merge them into one")
    children = node.value if isinstance(node, yaml.SequenceNode) else \
        [n for kv in node.value for n in kv] if isinstance(node, yaml.MappingNode) else []
    for child in children:
        _refuse_duplicate_keys(child, seen_nodes)


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:  # read from the file, YAML's marks name it (file:line)
            data = yaml.load(f, Loader=_UniqueKeyLoader)
    except AliasBomb as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def require(cond: bool, message: str) -> None:
    """Validation helper for __post_init__: raise ConfigError(message) unless cond."""
    if not cond:
        raise ConfigError(message)

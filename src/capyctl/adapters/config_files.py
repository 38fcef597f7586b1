"""YAML files CapyCTL reads (deployment files, the server configuration), loaded strictly.

PyYAML silently keeps the last of two equal keys; a file with a duplicated
key is a mistake the operator must hear about, so the loader refuses it,
naming the key and its line. ``decode_file`` also keeps where each key was
written, so that a key the struct refuses (unknown, or of the wrong type) is
reported with its line too.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

from capyctl.domain.errors import InvalidConfig
from capyctl.domain.units import MEANINGS

T = TypeVar("T")
_AT = re.compile(r"^(?P<what>.*?)(?: - at `(?P<path>\$[^`]*)`)?$", re.S)
_UNKNOWN = re.compile(r"unknown field `(?P<key>[^`]+)`")
_PART = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


class _StrictLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no types: SafeLoader is Any here
    pass


def _mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise InvalidConfig(f"duplicate key {key!r} on line {key_node.start_mark.line + 1}")
        seen.add(key)
    mapping: dict[Any, Any] = loader.construct_mapping(node, deep=deep)
    return mapping


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)  # safe: a SafeLoader subclass
    except InvalidConfig as exc:
        raise InvalidConfig(f"{source}: {exc.message}") from exc
    except yaml.YAMLError as exc:
        raise InvalidConfig(f"{source} is not valid YAML: {exc}") from exc


def load_yaml_file(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidConfig(f"cannot read {path}: {exc.strerror}") from exc
    return load_yaml(text, str(path))


def key_lines(text: str) -> dict[tuple[Any, ...], int]:
    """Where each key (by its path of keys and list indexes) is written: its line number, from 1."""
    lines: dict[tuple[Any, ...], int] = {}

    def walk(node: yaml.Node, path: tuple[Any, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                here = (*path, key_node.value)
                lines[here] = key_node.start_mark.line + 1
                walk(value_node, here)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                lines[(*path, index)] = item.start_mark.line + 1
                walk(item, (*path, index))

    try:
        root = yaml.compose(text, Loader=_StrictLoader)  # safe: a SafeLoader subclass
    except yaml.YAMLError:
        return lines
    if root is not None:
        walk(root, ())
    return lines


def _where(error: msgspec.ValidationError, lines: dict[tuple[Any, ...], int]) -> str:
    """msgspec's message with the line of the key it is about, when the file has it."""
    match = _AT.match(str(error))
    what, at = (match.group("what"), match.group("path")) if match else (str(error), None)
    path: tuple[Any, ...] = ()
    for name, index in _PART.findall(at or ""):
        path += (name,) if name else (int(index),)
    for pattern, meaning in MEANINGS.items():
        what = what.replace(f"`str` matching regex {pattern!r}", meaning)
    unknown = _UNKNOWN.search(what)
    if unknown:
        path += (unknown.group("key"),)
    key = ".".join(str(p) for p in path)
    line = lines.get(path)
    place = f"line {line}: " if line else ""
    return f"{place}{what}" + (f" (at {key})" if key and not unknown else "")


def decode_file(path: Path, kind: type[T]) -> T:
    """Read ``path`` and convert it strictly to ``kind``; every error names the file, and the line when known."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidConfig(f"cannot read {path}: {exc.strerror}") from exc
    return decode_text(text, str(path), kind)


def decode_text(text: str, source: str, kind: type[T]) -> T:
    document = load_yaml(text, source)
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise InvalidConfig(f"{source}: the file must be a mapping of keys to values")
    try:
        return msgspec.convert(document, kind)
    except msgspec.ValidationError as exc:
        raise InvalidConfig(f"{source}: {_where(exc, key_lines(text))}") from exc
    except InvalidConfig as exc:
        raise InvalidConfig(f"{source}: {exc.message}") from exc

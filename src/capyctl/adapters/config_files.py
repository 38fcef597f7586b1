"""YAML files CapyCTL reads (deployment files), loaded strictly.

PyYAML silently keeps the last of two equal keys; a deployment file with a
duplicated key is a mistake the operator must hear about, so the loader
refuses it, naming the key and its line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from capyctl.domain.errors import InvalidConfig


class _StrictLoader(yaml.SafeLoader):
    pass


def _mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise InvalidConfig(f"duplicate key {key!r} on line {key_node.start_mark.line + 1}")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
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

"""Registered engine installations."""

from __future__ import annotations

import enum

import msgspec


class EngineFamily(enum.StrEnum):
    LLAMACPP = "llamacpp"


class EngineInstall(msgspec.Struct, kw_only=True, frozen=True):
    """One engine installation on this machine, with the version it reported."""

    name: str
    family: EngineFamily
    path: str
    version: str
    version_text: str

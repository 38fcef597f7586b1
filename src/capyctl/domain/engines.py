"""Registered engine installations."""

from __future__ import annotations

import enum

import msgspec


class EngineFamily(enum.StrEnum):
    LLAMACPP = "llamacpp"
    VLLM = "vllm"
    SGLANG = "sglang"
    TENSORFOLD = "tensorfold"


def version_key(version: str) -> tuple[int, ...]:
    """Sortable key of a version: "0.5.21" -> (0, 5, 21); a llama.cpp build "b6123" -> (0, 0, 6123).

    Anything after the numeric part ("rc1", "+cpu", "-dev") is ignored.
    """
    text = version.lstrip("vb")
    parts: list[int] = []
    for piece in text.split("."):
        digits = ""
        for char in piece:
            if not "0" <= char <= "9":  # ASCII digits only: "²".isdigit() is True
                break
            digits += char
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    if version.startswith("b") and len(parts) == 1:
        return (0, 0, parts[0])
    return tuple(parts) or (0,)


class EngineInstall(msgspec.Struct, kw_only=True, frozen=True):
    """One engine installation on this machine, with the version it reported."""

    name: str
    family: EngineFamily
    path: str
    version: str
    version_text: str

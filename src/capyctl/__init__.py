"""CapyCTL: one authenticated OpenAI-compatible endpoint in front of self-hosted LLM engines."""

import functools


def __getattr__(name: str) -> str:
    """``__version__``, read from the installed distribution when first asked: importlib.metadata costs about
    20 ms to import, which every ``capyctl`` command would otherwise pay at its start."""
    if name == "__version__":
        return _version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("capyctl")
    except PackageNotFoundError:  # running from a source tree that was not installed
        return "0.0.0"

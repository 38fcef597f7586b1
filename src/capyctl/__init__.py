"""CapyCTL: one authenticated OpenAI-compatible endpoint in front of self-hosted LLM engines."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("capyctl")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0"

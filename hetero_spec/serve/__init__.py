"""The OpenAI-compatible server (`hetero-spec serve`)."""

from .app import create_app, serve

__all__ = ["create_app", "serve"]

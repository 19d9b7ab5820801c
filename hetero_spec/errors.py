"""Errors users see. Each one says what was wrong, where, and with which value."""

from typing import Any


class HeteroSpecError(Exception):
    """Base class of every error hetero_spec raises on purpose."""


class ConfigError(HeteroSpecError):
    """A config file, a key in it, or a `--set` override is invalid."""

    def __init__(self, source: str, key_path: str, value: Any, problem: str, show_value: bool = True):
        self.source, self.key_path, self.value, self.problem = source, key_path, value, problem
        where = f"{source}: {key_path}" if key_path else source
        super().__init__(f"{where} = {value!r}: {problem}" if show_value else f"{where}: {problem}")


class ModelLoadError(HeteroSpecError):
    """A model directory is missing or cannot be loaded."""


class VocabMismatchError(HeteroSpecError):
    """The draft and the target cannot emit the same token ids."""


class PromptTooLongError(HeteroSpecError):
    """The prompt leaves no room for a new token inside the model's context."""


class RequestError(HeteroSpecError):
    """A generation request has an invalid argument."""


class EngineClosedError(HeteroSpecError):
    """A request reached an Engine after close()."""


class BenchError(HeteroSpecError):
    """`hetero-spec bench` cannot run as asked; the message names the bad value."""


class QueueFullError(HeteroSpecError):
    """serving.max_waiting requests already wait for a place in the batch: try again later."""

    retry_after_s: float = 1.0
    """When to try again (the server's Retry-After)."""

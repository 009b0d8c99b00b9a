"""Exceptions with messages that name the problem and the fix."""

import json
import os
from typing import Any


class HeteroJaxError(Exception):
    """Base class for all hetero-jax errors."""


class ConfigError(HeteroJaxError, ValueError):
    """A model config that is missing, malformed or unsupported."""


class CheckpointError(HeteroJaxError, ValueError):
    """A checkpoint (ours, safetensors or GGUF) that is missing, incomplete or inconsistent."""


class PromptError(HeteroJaxError, ValueError):
    """A prompt that cannot be run (empty, or longer than the model's context)."""


class OutputError(HeteroJaxError, ValueError):
    """An output path that cannot be written, or whose write would replace an input or another output."""


def read_json(path: str, error: type[HeteroJaxError], *, missing: str, fix: str) -> Any:
    """The JSON value in ``path``.

    A missing file raises ``error(missing)``; a file that is not UTF-8 JSON raises ``error`` naming the
    path, the parser's complaint and ``fix`` (what the user should do about it).
    """
    if not os.path.isfile(path):
        raise error(missing)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path} is not valid JSON ({e}); {fix}") from None

"""Exceptions with messages that name the problem and the fix."""

import json
import os
from typing import Any


class HeteroJaxError(Exception):
    """Base class for all hetero-jax errors."""


class ConfigError(HeteroJaxError, ValueError):
    """A model config (or a setting such as an environment variable) that is missing, malformed or unsupported."""


class CheckpointError(HeteroJaxError, ValueError):
    """A checkpoint (ours, safetensors or GGUF) that is missing, incomplete or inconsistent."""


class PromptError(HeteroJaxError, ValueError):
    """A prompt that cannot be run (empty, or longer than the model's context)."""


class OutputError(HeteroJaxError, ValueError):
    """An output path that cannot be written, or whose write would replace an input or another output."""


class SessionError(HeteroJaxError, RuntimeError):
    """A ``Session`` that cannot answer now (busy in another thread, or its cache was lost)."""


class SessionBusyError(SessionError):
    """A second ``Session.ask`` while the first is still answering (in another thread)."""


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """The boolean environment variable ``name`` (``default`` when unset or empty).

    True: 1/true/yes/on; false: 0/false/no/off (case and surrounding whitespace ignored). Anything else
    is a ConfigError naming the variable and the allowed values: a typo must not flip a setting silently.
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ConfigError(f"environment variable {name}={raw!r} is not a boolean: use one of "
                      f"{'/'.join(TRUE_WORDS)} (on) or {'/'.join(FALSE_WORDS)} (off), or unset it "
                      f"(default: {'on' if default else 'off'})")


def read_json(path: str, error: type[HeteroJaxError], *, missing: str, fix: str) -> Any:
    """The JSON value in ``path``.

    A missing file raises ``error(missing)``; a file that is not UTF-8 JSON raises ``error`` naming the
    path, the parser's complaint and ``fix`` (what the user should do about it).
    """
    if os.path.isdir(path):
        raise error(f"{path} is a directory, not a file; {fix}")
    if not os.path.isfile(path):
        raise error(missing)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path} is not valid JSON ({e}); {fix}") from None


INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C


def exit_console(code: int):
    """End a console script with ``code``. After an interrupt (``INTERRUPTED``, its one line printed) the
    process ends at once: worker threads of the checkpoint reader (orbax) may still be finishing, and a normal
    interpreter exit let them print tracebacks into the event loop the interrupt closed. Everything the command
    wrote is already whole or removed (its ``finally`` blocks ran on the way out of ``main``)."""
    import sys

    if code == INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

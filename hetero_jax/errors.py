"""Exceptions with messages that name the problem and the fix."""


class HeteroJaxError(Exception):
    """Base class for all hetero-jax errors."""


class ConfigError(HeteroJaxError, ValueError):
    """A model config that is missing, malformed or unsupported."""


class CheckpointError(HeteroJaxError, ValueError):
    """A checkpoint (ours, safetensors or GGUF) that is missing, incomplete or inconsistent."""


class PromptError(HeteroJaxError, ValueError):
    """A prompt that cannot be run (empty, or longer than the model's context)."""

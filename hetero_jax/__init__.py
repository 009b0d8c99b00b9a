"""hetero-jax: long-context LLM inference in JAX with heterogeneous KV-cache compression."""

__version__ = "0.1.0"

from hetero_jax.model.config import ModelConfig, SUPPORTED_ARCHITECTURES  # noqa: E402
from hetero_jax.errors import (CheckpointError, ConfigError, HeteroJaxError, OutputError, PromptError,  # noqa: E402
                               SessionBusyError, SessionError)
from hetero_jax.runtime import (GenerationResult, GenerationStats, LaunchError, Session, generate,  # noqa: E402
                                initialize_distributed)
from hetero_jax.io.hub import load, place  # noqa: E402
from hetero_jax.model.sharding import make_mesh  # noqa: E402

__all__ = [
    "ModelConfig",
    "SUPPORTED_ARCHITECTURES",
    "CheckpointError",
    "ConfigError",
    "HeteroJaxError",
    "OutputError",
    "PromptError",
    "SessionBusyError",
    "SessionError",
    "LaunchError",
    "GenerationResult",
    "GenerationStats",
    "generate",
    "Session",
    "load",
    "place",
    "make_mesh",
    "initialize_distributed",
]

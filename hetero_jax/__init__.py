"""hetero-jax: long-context LLM inference in JAX with heterogeneous KV-cache compression."""

__version__ = "0.1.0"

import inspect  # noqa: E402

from hetero_jax.model.config import ModelConfig, SUPPORTED_ARCHITECTURES  # noqa: E402
from hetero_jax.errors import (CheckpointError, ConfigError, HeteroJaxError, OutputError, PromptError,  # noqa: E402
                               SessionBusyError, SessionError)
from hetero_jax import runtime  # noqa: E402
from hetero_jax.runtime import (GenerationResult, GenerationStats, LaunchError, exit_on_failure,  # noqa: E402
                                initialize_distributed)
from hetero_jax.io.hub import load, place  # noqa: E402
from hetero_jax.model.sharding import MeshError, make_mesh  # noqa: E402

# the errors of the floors ``import hetero_jax`` does not load (policies, profiles), read on first use
_LAZY_ERRORS = {"BudgetError": "hetero_jax.policies", "PolicyError": "hetero_jax.policies",
                "UnknownOptionError": "hetero_jax.policies", "UnknownPolicyError": "hetero_jax.policies",
                "ProfileError": "hetero_jax.profile.schema"}


def __getattr__(name):
    if name in _LAZY_ERRORS:
        import importlib

        return getattr(importlib.import_module(_LAZY_ERRORS[name]), name)
    raise AttributeError(f"module 'hetero_jax' has no attribute {name!r}")


def _default_policy(policy):
    from hetero_jax.policies import default_policy  # on first use: ``import hetero_jax`` stays light

    return default_policy(policy)


def generate(model, prompt, policy=None, **options):
    """:func:`hetero_jax.runtime.generate` (its ``options``: max_new_tokens, temperature, top_p, seed, stop,
    chat, on_token) with ``policy=None`` meaning full KV. The runtime takes a policy object; the default is
    filled here, at the top floor, since the runtime sits below policies/ (docs/architecture.md, "Layering")."""
    return runtime.generate(model, prompt, _default_policy(policy), **options)


class Session(runtime.Session):
    """:class:`hetero_jax.runtime.Session` (its ``options``: chat, seed, reserve_tokens) with ``policy=None``
    meaning full KV."""

    def __init__(self, model, context, policy=None, **options):
        super().__init__(model, context, _default_policy(policy), **options)


# help() and inspect show the options themselves (the runtime's signatures, policy=None included)
generate.__signature__ = inspect.signature(runtime.generate)
Session.__init__.__signature__ = inspect.signature(runtime.Session.__init__)


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
    "MeshError",
    *_LAZY_ERRORS,
    "GenerationResult",
    "GenerationStats",
    "generate",
    "Session",
    "load",
    "place",
    "make_mesh",
    "exit_on_failure",
    "initialize_distributed",
]

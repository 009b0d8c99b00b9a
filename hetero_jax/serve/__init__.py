"""``hetero-jax serve``: an OpenAI-compatible HTTP server whose conversations keep their compressed KV cache
between requests (docs/serve.md). The top floor beside the CLI: it imports the runtime, io and policies, and
nothing in the library imports it."""

from hetero_jax.serve.app import ServeConfig, create_app
from hetero_jax.serve.background import BackgroundServer
from hetero_jax.serve.sessions import parse_size

__all__ = ["BackgroundServer", "ServeConfig", "create_app", "parse_size"]

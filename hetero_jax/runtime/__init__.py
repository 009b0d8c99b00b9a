"""Serving: the compile cache, prompt checks, sampling, the engine, ``generate`` and ``Session``; joining a
multi-process job from its environment (``initialize_distributed``).

``generate`` lives in ``_generate.py`` so the function does not shadow a module of the same name.
"""

from hetero_jax.runtime._generate import generate
from hetero_jax.runtime.compile_cache import (MAX_CHUNK, TAIL_QUANTUM, chunk_bucket, compile_seconds, compiled,
                                              release_executables, tail_capacity_for)
from hetero_jax.runtime.distributed import (LaunchError, ProcessSetup, exit_on_failure, initialize_distributed,
                                            process_setup)
from hetero_jax.runtime.engine import Engine, bind_policy, prefill
from hetero_jax.runtime.results import GenerationResult, GenerationStats
from hetero_jax.runtime.sampling import sample
from hetero_jax.runtime.session import Session

__all__ = ["Engine", "GenerationResult", "GenerationStats", "LaunchError", "MAX_CHUNK", "ProcessSetup", "Session",
           "TAIL_QUANTUM", "bind_policy", "chunk_bucket", "compile_seconds", "compiled", "exit_on_failure", "generate",
           "initialize_distributed", "prefill", "process_setup", "release_executables", "sample", "tail_capacity_for"]

"""Checkpoint import: HF safetensors directories and llama GGUF files -> hetero-jax checkpoints."""

from hetero_jax.io.gguf import convert_gguf, smollm2_gguf_path
from hetero_jax.io.hf import ConversionResult, convert_hf

__all__ = ["ConversionResult", "convert_gguf", "convert_hf", "smollm2_gguf_path"]

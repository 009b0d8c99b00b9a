"""Checkpoint import: HF safetensors directories and llama GGUF files -> hetero-jax checkpoints."""

from convert.gguf_import import convert_gguf, smollm2_gguf_path
from convert.hf import ConversionResult, convert_hf

__all__ = ["ConversionResult", "convert_gguf", "convert_hf", "smollm2_gguf_path"]

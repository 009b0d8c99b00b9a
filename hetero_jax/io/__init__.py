"""Getting weights in: our checkpoint format, HF safetensors and GGUF conversion, the model hub, tokenizers."""

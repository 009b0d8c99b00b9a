"""Tiny random Hugging Face models (Llama, Qwen2, Qwen3) saved as safetensors dirs, for conversion/parity tests.

``make_tiny_hf(arch, path)`` writes config.json, model.safetensors (or shards +
index), tokenizer.json and tokenizer_config.json (with a chat template) and
returns ``path``. All weights are random (norms and biases too, so a
mis-mapped tensor cannot hide behind an all-ones init); float32; deterministic.
"""

from __future__ import annotations

import json
import os

VOCAB_SIZE = 320  # the byte-level alphabet (256) + merges + specials
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_TRAIN_TEXT = (
    "The quick brown fox jumps over the lazy dog. Long context inference keeps the key value cache "
    "of every head; heterogeneous caches keep only what matters. 0123456789 the a an of to in is "
) * 20

ARCHS = ("llama", "qwen2", "qwen3")


def _config(arch: str, **llama_options):
    """``llama_options`` replace the tiny Llama's settings (e.g. attention_bias=True, rope_scaling=None)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB_SIZE, num_hidden_layers=2, rms_norm_eps=1e-5, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        return LlamaConfig(**{**dict(
            hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2,
            max_position_embeddings=512, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 500000.0},
            rope_theta=500000.0, **common), **llama_options})
    if arch == "qwen2":
        # 7 query heads per KV head, head_dim 16 -> hidden 112.
        return Qwen2Config(hidden_size=112, intermediate_size=160, num_attention_heads=7, num_key_value_heads=1,
                           max_position_embeddings=512, tie_word_embeddings=False, rope_theta=1000000.0, **common)
    if arch == "qwen3":
        # head_dim 32 != hidden / heads (16); tied embeddings.
        return Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, max_position_embeddings=512, tie_word_embeddings=True,
                           rope_theta=1000000.0, **common)
    raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")


def make_tokenizer_files(path: str | os.PathLike) -> None:
    """A small byte-level BPE tokenizer.json (VOCAB_SIZE tokens) + tokenizer_config.json with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_TRAIN_TEXT], trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB_SIZE
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "add_bos_token": False, "chat_template": CHAT_TEMPLATE,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2)


def make_tiny_model(arch: str, seed: int = 0, **llama_options):
    """The torch model (float32, eval mode) with every parameter randomised."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, **llama_options), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    return model


def make_tiny_hf(arch: str, path: str | os.PathLike, *, max_shard_size: str | None = None, seed: int = 0) -> str:
    """Save a tiny random ``arch`` model ("llama" | "qwen2" | "qwen3") + tokenizer to ``path``; returns it.

    ``max_shard_size`` (e.g. "50KB") makes save_pretrained write shards and model.safetensors.index.json.
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    model = make_tiny_model(arch, seed)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kw)
    make_tokenizer_files(path)
    return path


def hf_greedy_ids(model, prompt_ids, max_new_tokens: int, eos_ids) -> list:
    """transformers' greedy continuation of ``prompt_ids``, cut before the first EOS (as generate() reports it)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt_ids)]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=list(eos_ids), pad_token_id=0)
    ids = out[0, len(prompt_ids):].tolist()
    eos = set(eos_ids)
    return ids[: next((i for i, t in enumerate(ids) if t in eos), len(ids))]


def convert_refused(args, out_parent, capsys, *needles) -> str:
    """Run ``hetero-jax-convert`` on ``args`` expecting exit 2: the message starts with 'error: ' and names each
    needle, and nothing was written into ``out_parent`` (no OUT_DIR, no temporary leftovers). Returns stderr."""
    from convert.cli import main as convert_main

    before = sorted(os.listdir(out_parent))
    assert convert_main([*map(str, args), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: "), err
    for n in needles:
        assert n in err, f"{n!r} not in {err!r}"
    assert sorted(os.listdir(out_parent)) == before
    return err

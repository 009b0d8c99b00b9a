"""Logit parity with HF transformers (CPU torch, float32) for tiny random checkpoints
saved by transformers as safetensors and converted by our CLI."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import hetero_jax
from hetero_jax.model import transformer as M
from hetero_jax.runtime import prefill

from hf_fixtures import hf_greedy_ids, make_tiny_model

ATOL = 1e-4
DECODE_STEPS = 16


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_prefill_and_greedy_decode_logits_match_transformers(arch, tiny_checkpoint):
    hf_dir, ours = tiny_checkpoint(arch)
    bundle = hetero_jax.load(ours)
    cfg = bundle.config
    hf = make_tiny_model(arch)  # same seed -> same weights as the saved checkpoint
    prompt = np.random.default_rng(7).integers(3, cfg.vocab_size, size=45).tolist()

    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].numpy()
    every, _ = prefill(bundle.params, cfg, [prompt], tail_capacity=DECODE_STEPS, all_logits=True)
    assert np.abs(np.asarray(every[0, : len(prompt)]) - ref).max() <= ATOL  # every prompt position
    logits, cache = prefill(bundle.params, cfg, [prompt], tail_capacity=DECODE_STEPS)
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(every[0, len(prompt) - 1]), atol=1e-5, rtol=0)

    seq = list(prompt)
    nxt = int(np.argmax(np.asarray(logits[0])))
    worst = 0.0
    for _ in range(DECODE_STEPS):
        seq.append(nxt)
        lg, cache = M.decode_step_jit(bundle.params, cache, jnp.asarray([nxt], jnp.int32), cfg)
        with torch.no_grad():
            r = hf(torch.tensor([seq])).logits[0, -1].numpy()
        worst = max(worst, float(np.abs(np.asarray(lg[0]) - r).max()))
        nxt = int(np.argmax(np.asarray(lg[0])))
        assert nxt == int(np.argmax(r))
    assert worst <= ATOL, f"decode logits differ from transformers by {worst}"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_generate_greedy_matches_transformers_generate(arch, tiny_checkpoint):
    _, ours = tiny_checkpoint(arch)
    bundle = hetero_jax.load(ours)
    hf = make_tiny_model(arch)
    prompt = np.random.default_rng(11).integers(3, bundle.config.vocab_size, size=30).tolist()
    res = hetero_jax.generate(bundle, prompt, max_new_tokens=DECODE_STEPS, chat=False)
    assert res.token_ids == hf_greedy_ids(hf, prompt, DECODE_STEPS, bundle.tokenizer.eos_token_ids)

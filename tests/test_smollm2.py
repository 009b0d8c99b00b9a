"""The real embedded SmolLM2-135M through our GGUF import against transformers' own GGUF loader."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import hetero_jax
from hetero_jax.model import transformer as M
from hetero_jax.runtime import prefill

from hf_fixtures import hf_greedy_ids

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

CHAT = "Explain in a few sentences why the sky is blue."


def test_greedy_chat_continuation_matches_transformers(smollm2, hf_smollm2):
    hf, _ = hf_smollm2
    n_new = 40
    res = hetero_jax.generate(smollm2, CHAT, max_new_tokens=n_new)
    ids = smollm2.tokenizer.encode_prompt(CHAT, chat=True)
    ref = hf_greedy_ids(hf, ids, n_new, smollm2.tokenizer.eos_token_ids)
    assert len(res.token_ids) >= 32, res.text
    assert res.token_ids == ref
    assert "blue" in res.text.lower() or "scatter" in res.text.lower()


def test_logits_close_to_transformers(smollm2, hf_smollm2):
    hf, _ = hf_smollm2
    ids = smollm2.tokenizer.encode_prompt(CHAT, chat=True)
    every, cache = prefill(smollm2.params, smollm2.config, [ids], tail_capacity=8, all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    ours = np.asarray(every[0, : len(ids)])
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() <= 2e-4 * scale, np.abs(ours - ref).max()
    # one decode step too
    nxt = int(ours[-1].argmax())
    lg, _ = M.decode_step_jit(smollm2.params, cache, jnp.asarray([nxt], jnp.int32), smollm2.config)
    with torch.no_grad():
        r = hf(torch.tensor([ids + [nxt]])).logits[0, -1].numpy()
    assert np.abs(np.asarray(lg[0]) - r).max() <= 2e-4 * scale


def test_batch_of_chat_prompts_equals_one_by_one(smollm2):
    prompts = ["Name three primary colors.", "What is the capital of Japan? Answer briefly, then add one fact about it."]
    batch = hetero_jax.generate(smollm2, prompts, max_new_tokens=24)
    for p, b in zip(prompts, batch):
        alone = hetero_jax.generate(smollm2, p, max_new_tokens=24)
        assert b.token_ids == alone.token_ids
        assert b.text == alone.text

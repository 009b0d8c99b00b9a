"""Our GGUF-built SmolLM2 tokenizer vs transformers' GGUF tokenizer (independent reference)."""

from __future__ import annotations

import re

import pytest

from hetero_jax.errors import PromptError
from hetero_jax.io.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "naïve café",
    "日本語のテキスト",
    "emoji: 🎉🚀 and 👩‍💻",
    "def f(x):\n    return x ** 2  # square\n",
    "digits 12345 and 3.14159, 1e-5",
    "  leading spaces,   runs   of  spaces\t\ttabs",
    "line one\n\n\nline four\r\nwindows",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "It's they're we've I'm you'll he'd",
    "",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "naïve café 日本"}],
]


@pytest.fixture(scope="module")
def ours(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def ref(hf_smollm2):
    return hf_smollm2[1]


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours, ref, text):
    assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == ref.encode(text, add_special_tokens=True)


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(ours, ref, text):
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(ours, ref, messages, gen):
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected


@pytest.mark.real_model
@pytest.mark.slow
def test_special_ids_and_prompt(ours, ref):
    assert ours.bos_token_id == ref.bos_token_id == 1
    assert ref.eos_token_id in ours.eos_token_ids
    assert ours.pad_token_id == ref.pad_token_id
    ids = ours.encode_prompt("Hi there")
    expected = ref.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=True,
                                       add_generation_prompt=True)
    if isinstance(expected, dict) or hasattr(expected, "keys"):
        expected = expected["input_ids"]
    assert ids == list(expected)
    assert ours.encode_prompt("Hi there", chat=False) == ref.encode("Hi there")


def _tiny_backend():
    from tokenizers import Tokenizer as T, models, pre_tokenizers

    tok = T(models.WordLevel({"<unk>": 0, "a": 1, "b": 2, "<s>": 3, "</s>": 4}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def test_no_chat_template_raises_clear_error():
    tok = Tokenizer(_tiny_backend(), tokenizer_config={"bos_token": "<s>", "eos_token": "</s>"})
    assert tok.chat_template is None
    with pytest.raises(PromptError, match="--no-chat"):
        tok.encode_prompt("a b")
    assert tok.encode_prompt("a b", chat=False) == [1, 2]
    assert tok.bos_token_id == 3 and tok.eos_token_ids == (4,) and tok.pad_token_id == 4


def test_template_features_tojson_raise_exception():
    template = ("{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
                "{{ bos_token }}{{ m | tojson }}\n{% endfor %}{% if add_generation_prompt %}GO{% endif %}")
    tok = Tokenizer(_tiny_backend(), tokenizer_config={"bos_token": {"content": "<s>"}, "eos_token": "</s>",
                                                       "chat_template": template})
    out = tok.apply_chat_template([{"role": "user", "content": "é"}])
    assert out == '<s>{"role": "user", "content": "é"}\nGO'
    # content written as JSON (escaped) is still the user's text
    assert tok.apply_chat_template([{"role": "user", "content": 'say "hi"\n'}]).startswith('<s>{"role": "user"')
    # the template's own refusal is the project's error (issue 37), naming it and the ways out
    with pytest.raises(PromptError, match=re.escape("the checkpoint's chat template refused the conversation "
                                                    "(TemplateError: no bad roles); pass chat=False")):
        tok.apply_chat_template([{"role": "bad", "content": "x"}])


def test_from_dir_collects_eos_ids(tmp_path):
    import json

    _tiny_backend().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [4, 2], "bos_token_id": 3}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == (4, 2, 1) and tok.bos_token_id == 3
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == "a"
    assert tok.decode(tok.encode("a b")) == "a b"

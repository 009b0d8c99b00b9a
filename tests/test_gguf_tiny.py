"""Tiny llama GGUFs written as llama.cpp's convert_hf_to_gguf.py writes them (tensors renamed, Q/K rows and
biases permuted, a byte-level BPE vocabulary in the metadata), imported and held tensor by tensor to the torch
model they came from; metadata and tensors the importer must refuse before it dequantises anything."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from convert.cli import main as convert_main  # noqa: E402
from hetero_jax.io import gguf as importer  # noqa: E402
from hetero_jax.io.checkpoint import load_checkpoint  # noqa: E402
from hetero_jax.model.spec import hf_tensor_map  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from hf_fixtures import make_tiny_model, make_tokenizer_files  # noqa: E402

_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: half-split RoPE pairs to interleaved rows (weights and biases)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(model) -> dict[str, np.ndarray]:
    cfg = model.config
    out = {}
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy()
        top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
        if name in top:
            out[top[name]] = a
            continue
        _, _, layer, *rest = name.split(".")
        module, kind = ".".join(rest[:-1]), rest[-1]
        if module.endswith("q_proj"):
            a = _permute(a, cfg.num_attention_heads)
        elif module.endswith("k_proj"):
            a = _permute(a, cfg.num_key_value_heads)
        out[f"blk.{layer}.{_LAYER[module]}.{kind}"] = a
    return out


def write_gguf(path, model, tok_dir, *, meta=None, drop=(), extra=None, token_edits=None, pre="default") -> str:
    """F32 tensors. ``pre``: tokenizer.ggml.pre; ``meta``: metadata setters of GGUFWriter replaced (name -> value,
    None: not written);
    ``drop``: tensor names left out; ``extra``: tensors added (name -> (array, GGML type name));
    ``token_edits``: vocabulary entries replaced (id -> (text, token type))."""
    cfg = model.config
    tj = json.load(open(os.path.join(tok_dir, "tokenizer.json")))
    vocab = {**tj["model"]["vocab"], **{a["content"]: a["id"] for a in tj["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    types = [3 if t.startswith("<|") else 1 for t in tokens]
    for i, (text, kind) in (token_edits or {}).items():
        tokens[i], types[i] = text, kind
    w = gguf.GGUFWriter(os.fspath(path), "llama")
    setters = {"add_block_count": cfg.num_hidden_layers, "add_context_length": cfg.max_position_embeddings,
               "add_embedding_length": cfg.hidden_size, "add_feed_forward_length": cfg.intermediate_size,
               "add_head_count": cfg.num_attention_heads, "add_head_count_kv": cfg.num_key_value_heads,
               "add_layer_norm_rms_eps": cfg.rms_norm_eps, "add_rope_freq_base": 10000.0,
               "add_bos_token_id": 1, "add_eos_token_id": 2, "add_token_list": tokens}
    for fn, v in {**setters, **(meta or {})}.items():
        if v is not None:
            getattr(w, fn)(v)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    for name, a in _gguf_tensors(model).items():
        if name not in drop:
            w.add_tensor(name, a.astype(np.float32))
    for name, (a, kind) in (extra or {}).items():
        qt = gguf.GGMLQuantizationType[kind]
        w.add_tensor(name, gguf.quants.quantize(a, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    make_tokenizer_files(d)
    return d


def _model(**options):
    # GGUF carries no llama3 rope scaling here: the reference is a plain rope at theta 10000
    return make_tiny_model("llama", rope_scaling=None, rope_theta=10000.0, **options)


@pytest.mark.parametrize("options", [dict(), dict(attention_bias=True)])
def test_tensors_equal_the_torch_model_they_came_from(options, tok_dir, tmp_path):
    """Attention biases (HF Llama's attention_bias, written by llama.cpp as attn_*.bias and permuted like the
    weights) were refused as 'unexpected tensor' although the importer maps them."""
    model = _model(**options)
    src = write_gguf(tmp_path / "m.gguf", model, tok_dir)
    assert convert_main(["--gguf", src, str(tmp_path / "ck"), "--no-progress"]) == 0
    cfg, params, _ = load_checkpoint(tmp_path / "ck")
    assert (cfg.qkv_bias, cfg.o_bias) == (bool(options), bool(options))
    ref = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    names = [hf for hf, *_ in hf_tensor_map(cfg)]
    assert set(names) == set(ref)
    for hf, path, _, transpose in hf_tensor_map(cfg):
        ours = np.asarray(params[path[0]] if len(path) == 1 else params["layers"][path[1]][path[2]])
        np.testing.assert_array_equal(ours.T if transpose else ours, ref[hf], err_msg=hf)


@pytest.mark.parametrize("meta, needles", [
    ({"add_head_count": 0}, ["llama.attention.head_count = 0", "an integer >= 1"]),
    ({"add_head_count_kv": 3}, ["llama.attention.head_count = 8 is not a multiple of "
                                "llama.attention.head_count_kv = 3"]),
    ({"add_block_count": 0}, ["llama.block_count = 0"]),
    ({"add_layer_norm_rms_eps": 0.0}, ["llama.attention.layer_norm_rms_epsilon = 0.0", "a finite number > 0"]),
    ({"add_context_length": 1}, ["llama.context_length = 1", "an integer >= 2"]),
    ({"add_rope_freq_base": 0.0}, ["llama.rope.freq_base = 0.0"]),
    ({"add_bos_token_id": 100000}, ["tokenizer.ggml.bos_token_id = 100000 is outside the 320-token vocabulary"]),
    ({"add_token_list": None, "add_vocab_size": 320}, ["no tokenizer.ggml.tokens", "incomplete"]),
])
def test_bad_metadata_is_refused_naming_the_key(meta, needles, tok_dir, tmp_path, capsys, monkeypatch):
    """Each converted (or crashed: head_count 0 was a ZeroDivisionError, no token list a TypeError) and `load`
    then refused the checkpoint telling the user to fix a config.json they never wrote."""
    src = write_gguf(tmp_path / "m.gguf", _model(), tok_dir, meta=meta)
    monkeypatch.setattr(importer, "_dequantize", lambda t: pytest.fail("dequantised before the refusal"))
    assert convert_main(["--gguf", src, str(tmp_path / "ck"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: GGUF") and "config.json" not in err, err
    for n in needles:
        assert n in err, (n, err)
    assert sorted(os.listdir(tmp_path)) == ["m.gguf"]


def test_a_tensor_of_an_unsupported_type_is_refused_before_any_is_dequantised(tok_dir, tmp_path, capsys,
                                                                               monkeypatch):
    """llama.cpp writes output.weight last, often in another type (Q6_K beside Q4_0): the refusal came after
    every other tensor was dequantised."""
    model = _model()
    tensors = _gguf_tensors(model)
    src = write_gguf(tmp_path / "m.gguf", model, tok_dir, drop={"output.weight"},
                     extra={"output.weight": (tensors["output.weight"], "Q5_0")})
    monkeypatch.setattr(importer, "_dequantize", lambda t: pytest.fail("dequantised before the refusal"))
    assert convert_main(["--gguf", src, str(tmp_path / "ck"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "'output.weight' has quantisation type Q5_0, which is not supported" in err, err


def test_a_wrong_shape_names_the_gguf_tensor_and_metadata(tok_dir, tmp_path, capsys):
    model = _model()
    tensors = _gguf_tensors(model)
    bad = np.zeros((8, tensors["blk.1.attn_v.weight"].shape[1]), np.float32)
    src = write_gguf(tmp_path / "m.gguf", model, tok_dir, drop={"blk.1.attn_v.weight"},
                     extra={"blk.1.attn_v.weight": (bad, "F32")})
    assert convert_main(["--gguf", src, str(tmp_path / "ck"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "GGUF tensor 'blk.1.attn_v.weight'" in err and "the GGUF metadata" in err and "config.json" not in err


def test_control_and_user_defined_tokens_outside_the_byte_alphabet_keep_their_ids(tok_dir, tmp_path):
    """DeepSeek-R1-Distill-Llama's GGUF: its BOS '<｜begin▁of▁sentence｜>' (CONTROL) was respelled into the
    byte alphabet and split into ~20 byte tokens, and '<｜User｜>' (USER_DEFINED) got a new id past the
    embedding; each is now one token, its own GGUF id, as llama.cpp matches them."""
    from hetero_jax.io.tokenizer import Tokenizer

    bos, user = "<｜begin▁of▁sentence｜>", "<｜User｜>"
    src = write_gguf(tmp_path / "m.gguf", _model(), tok_dir, token_edits={1: (bos, 3), 0: (user, 4)},
                     meta={"add_chat_template": "{{ bos_token }}{% for m in messages %}<｜User｜>{{ m['content'] }}"
                                                "{% endfor %}"})
    assert convert_main(["--gguf", src, str(tmp_path / "ck"), "--no-progress"]) == 0
    tok = Tokenizer.from_dir(tmp_path / "ck")
    hi = tok.encode("hi")
    assert tok.encode(f"{bos}{user}hi") == [1, 0, *hi]
    assert tok.vocab_size == 320 and tok.token_to_id(user) == 0 and tok.bos_token == bos
    assert tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)) == [
        1, 0, *hi]
    assert tok.decode([1, 0, *hi], skip_special_tokens=False) == f"{bos}{user}hi"


@pytest.mark.parametrize("pre, whole", [("llama-bpe", True), ("llama3", True), ("smaug-bpe", False),
                                        ("default", False)])
def test_llama3_vocabularies_take_a_piece_that_is_a_token_whole(pre, whole, tok_dir, tmp_path):
    """llama.cpp's LLAMA3 type (and HF's Llama-3 tokenizer.json, "ignore_merges": true) takes a pre-token piece
    that is a vocabulary entry as that one token before any merge, and adds BOS when the file does not say; the
    importer ran the merges, so a Llama-3 GGUF could split a word its HF tokenizer keeps whole, and no BOS."""
    from hetero_jax.io.tokenizer import Tokenizer

    tj = json.load(open(os.path.join(tok_dir, "tokenizer.json")))
    in_merges = {part for m in tj["model"]["merges"] for part in (m.split(" ") if isinstance(m, str) else m)}
    in_merges |= {"".join(m.split(" ") if isinstance(m, str) else m) for m in tj["model"]["merges"]}
    free = min(i for t, i in tj["model"]["vocab"].items() if t not in in_merges and i > 2)  # no merge needs it
    src = write_gguf(tmp_path / "m.gguf", _model(), tok_dir, pre=pre, token_edits={free: ("\u0120zzzz", 1)},
                     meta={"add_bos_token_id": 1})
    assert convert_main(["--gguf", src, str(tmp_path / "ck"), "--no-progress"]) == 0
    tok = Tokenizer.from_dir(tmp_path / "ck")
    ids = tok.encode("a zzzz", add_special_tokens=True)
    bos = [1] if whole else []  # the LLAMA3 type adds BOS when tokenizer.ggml.add_bos_token is absent
    assert ids[:len(bos)] == bos
    body = ids[len(bos):]
    assert (body[-1:] == [free]) == whole and (len(body) == 2) == whole, body
    assert tok.decode(body) == "a zzzz"


def test_eot_and_eom_ids_stop_generation_as_eos_does(tok_dir, tmp_path):
    """llama.cpp stops at tokenizer.ggml.eot_token_id / eom_token_id (Llama-3's <|eot_id|>) besides EOS; they
    were dropped, so an answer ran past the end of its turn."""
    from hetero_jax.io.checkpoint import load_checkpoint

    src = write_gguf(tmp_path / "m.gguf", _model(), tok_dir, meta={"add_eot_token_id": 0, "add_eom_token_id": 2})
    assert convert_main(["--gguf", src, str(tmp_path / "ck"), "--no-progress"]) == 0
    cfg, _, tok = load_checkpoint(tmp_path / "ck")
    assert cfg.eos_token_ids == (2, 0) and set(tok.eos_token_ids) >= {0, 2}


@pytest.mark.parametrize("meta, edits, extra, needles", [
    ({"add_chat_template": "{% for m in messages %}{{ m['content'] }"}, None, None,
     ["the model's chat template is not valid Jinja (line 1: unexpected '}')", "'s tokenizer.chat_template; fix the "
      "GGUF's tokenizer.chat_template"]),  # converted, then every load refused it
    ({"add_rope_dimension_count": 4}, None, None,
     ["llama.rope.dimension_count = 4 is not the head size 8", "partial rotary"]),  # was silently rotated whole
    (None, None, {"blk.0.weight": (np.zeros((4, 4), np.float32), "F32")},
     ["unexpected GGUF tensor 'blk.0.weight'"]),  # was a ValueError traceback
    (None, "merge part", None, ["the GGUF vocabulary is inconsistent", "re-download it"]),  # was a bare Exception
])
def test_damaged_or_unsupported_gguf_input_is_refused_before_any_tensor_is_dequantised(
        meta, edits, extra, needles, tok_dir, tmp_path, capsys, monkeypatch):
    if edits == "merge part":  # rename a token the first merge names
        tj = json.load(open(os.path.join(tok_dir, "tokenizer.json")))
        first = tj["model"]["merges"][0]
        part = (first.split(" ") if isinstance(first, str) else first)[0]
        edits = {tj["model"]["vocab"][part]: ("renamed", 1)}
    src = write_gguf(tmp_path / "m.gguf", _model(), tok_dir, meta=meta, extra=extra, token_edits=edits)
    monkeypatch.setattr(importer, "_dequantize", lambda t: pytest.fail("dequantised before the refusal"))
    assert convert_main(["--gguf", src, str(tmp_path / "ck"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: "), err
    for n in needles:
        assert n in err, (n, err)
    assert sorted(os.listdir(tmp_path)) == ["m.gguf"]

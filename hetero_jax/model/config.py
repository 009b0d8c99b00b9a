"""Model configuration built from a Hugging Face ``config.json``.

``ModelConfig`` is a frozen, hashable dataclass so it can be passed to jitted
functions as a static argument.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

from hetero_jax.errors import ConfigError, read_json

# HF ``architectures`` entry -> our architecture family.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# what transformers' Qwen2Config / Qwen3Config take for a key config.json leaves out (head_dim: Qwen3's only)
QWEN_DEFAULTS = {"num_key_value_heads": 32, "head_dim": 128, "sliding_window": 4096}


_FIX = "; fix config.json (it should match the checkpoint's published config.json)"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _need(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"config.json: {key} = {value!r} is not allowed; it must be {allowed}{_FIX}")


def check_hf_config_values(cfg: Any) -> None:
    """Types and ranges of the config.json entries ``from_hf_dict`` reads: ConfigError naming the key,
    its value and what is allowed, instead of a TypeError/ZeroDivisionError/KeyError further in."""
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"config.json must hold a JSON object (a mapping of settings), got {type(cfg).__name__}"
                          f"{_FIX}")
    archs = cfg.get("architectures")
    _need(archs is None or (isinstance(archs, list) and all(isinstance(a, str) for a in archs)),
          "architectures", archs, "a list of class names such as [\"LlamaForCausalLM\"]")
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size"):
        if key in cfg:  # a missing required key is reported by from_hf_dict
            _need(_is_int(cfg[key]) and cfg[key] >= 1, key, cfg[key], "a positive integer")
    for key in ("num_key_value_heads", "head_dim"):
        if cfg.get(key) is not None:
            _need(_is_int(cfg[key]) and cfg[key] >= 1, key, cfg[key], "a positive integer (or absent)")
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    # a Qwen3 config without the key has head_dim 128, not this (an explicit null: transformers refuses it)
    qwen3 = (cfg.get("architectures") or [None])[0] == "Qwen3ForCausalLM" and "head_dim" not in cfg
    if cfg.get("head_dim") is None and not qwen3 and _is_int(heads) and _is_int(hidden) and hidden % heads:
        raise ConfigError(f"config.json: hidden_size = {hidden} is not a multiple of num_attention_heads = {heads} "
                          f"and there is no head_dim; give head_dim{_FIX}")
    if "max_position_embeddings" in cfg:
        v = cfg["max_position_embeddings"]
        _need(_is_int(v) and v >= 2, "max_position_embeddings", v, "an integer >= 2")
    if "rms_norm_eps" in cfg:
        _need(_is_num(cfg["rms_norm_eps"]) and cfg["rms_norm_eps"] > 0, "rms_norm_eps", cfg["rms_norm_eps"],
              "a finite number > 0")
    if cfg.get("rope_theta") is not None:
        _need(_is_num(cfg["rope_theta"]) and cfg["rope_theta"] > 0, "rope_theta", cfg["rope_theta"],
              "a finite number > 0 (or absent)")
    for key in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
        if cfg.get(key) is not None:
            _need(isinstance(cfg[key], bool), key, cfg[key], "true or false")
    if cfg.get("bos_token_id") is not None:
        _need(_is_int(cfg["bos_token_id"]) and cfg["bos_token_id"] >= 0, "bos_token_id", cfg["bos_token_id"],
              "a token id (an integer >= 0) or null")
    eos = cfg.get("eos_token_id")
    if eos is not None:
        _need((_is_int(eos) and eos >= 0) or (isinstance(eos, list) and all(_is_int(e) and e >= 0 for e in eos)),
              "eos_token_id", eos, "a token id, a list of token ids or null")
    if cfg.get("original_max_position_embeddings") is not None:
        _need(_is_int(cfg["original_max_position_embeddings"]) and cfg["original_max_position_embeddings"] >= 1,
              "original_max_position_embeddings", cfg["original_max_position_embeddings"], "a positive integer")
    for key in ("rope_scaling", "rope_parameters"):
        if cfg.get(key) is not None:
            _need(isinstance(cfg[key], Mapping), key, cfg[key], "an object (mapping) or null")
            _check_rope_dict(key, cfg[key])


def _check_unported_math(cfg: Mapping, family: str, n_layers: int) -> None:
    """Refuse the config.json settings that change the model's maths in ways this port does not implement
    (its logits would differ from transformers'): an MLP activation other than SiLU, and Qwen's sliding-window
    layers with a window shorter than the context."""
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"config.json: hidden_act = {act!r} is not supported; hetero-jax implements the "
                          "SwiGLU MLP of Llama, Qwen2 and Qwen3 (hidden_act 'silu') only, and this checkpoint "
                          "would give wrong logits. Use a checkpoint with hidden_act 'silu'")
    # an absent key is transformers' Qwen2Config / Qwen3Config default window, 4096
    window = cfg.get("sliding_window", QWEN_DEFAULTS["sliding_window"]) if cfg.get("use_sliding_window") else None
    context = _context_length(cfg, family)
    if family == "llama" or not window or window >= context:
        return
    # transformers' Qwen2/Qwen3 rule: layer_types if given, else layers from max_window_layers on slide
    types = cfg.get("layer_types") or ["sliding_attention" if i >= cfg.get("max_window_layers", 28)
                                       else "full_attention" for i in range(n_layers)]
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding:
        raise ConfigError(f"config.json: use_sliding_window is true with sliding_window = {window} (shorter than "
                          f"the {context}-token context) for {len(sliding)} of "
                          f"{n_layers} layers; hetero-jax does not implement sliding-window attention and would "
                          "give wrong logits. Use a checkpoint whose config sets use_sliding_window false")


# transformers' class defaults when config.json has no max_position_embeddings
_HF_DEFAULT_CONTEXT = {"llama": 2048, "qwen2": 32768, "qwen3": 32768}


def _context_length(cfg: Mapping, family: str) -> int:
    return int(cfg.get("max_position_embeddings") or _HF_DEFAULT_CONTEXT[family])


def _check_rope_dict(key: str, d: Mapping) -> None:
    if "rope_type" not in d and "type" not in d and len(d) == 1 and isinstance(next(iter(d.values())), Mapping):
        (sub_key, d), = d.items()  # per-layer-type form {"full_attention": {...}}
        key = f"{key}.{sub_key}"
    if d.get("rope_theta") is not None:
        _need(_is_num(d["rope_theta"]) and d["rope_theta"] > 0, f"{key}.rope_theta", d["rope_theta"],
              "a finite number > 0")
    if d.get("rope_type", d.get("type")) != "llama3":
        return
    # original_max_position_embeddings may be absent: transformers then takes max_position_embeddings
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in d]
    if missing:
        raise ConfigError(f"config.json: {key} has rope_type 'llama3' but no {missing[0]!r}; llama3 scaling needs "
                          f"factor, low_freq_factor and high_freq_factor{_FIX}")
    for k in ("factor", "low_freq_factor", "high_freq_factor"):
        _need(_is_num(d[k]) and d[k] > 0, f"{key}.{k}", d[k], "a finite number > 0")
    if "original_max_position_embeddings" in d:
        _need(_is_int(d["original_max_position_embeddings"]) and d["original_max_position_embeddings"] >= 1,
              f"{key}.original_max_position_embeddings", d["original_max_position_embeddings"], "a positive integer")
    _need(d["high_freq_factor"] > d["low_freq_factor"], f"{key}.high_freq_factor", d["high_freq_factor"],
          f"greater than low_freq_factor = {d['low_freq_factor']!r}")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (``rope_type == "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of "llama", "qwen2", "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and Llama with attention_bias)
    o_bias: bool = False  # Llama with attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hf_architecture: str = "LlamaForCausalLM"

    @property
    def group_size(self) -> int:
        """Query heads per KV head (the GQA ratio)."""
        return self.num_heads // self.num_kv_heads

    # ------------------------------------------------------------------ HF I/O
    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        check_hf_config_values(cfg)
        archs = cfg.get("architectures") or []
        if not archs:
            raise ConfigError(
                "config.json has no 'architectures' entry; expected one of "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        hf_arch = archs[0]
        if hf_arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {hf_arch!r}; supported architectures: "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family = SUPPORTED_ARCHITECTURES[hf_arch]
        try:
            hidden = int(cfg["hidden_size"])
            num_heads = int(cfg["num_attention_heads"])
            # absent: the defaults of transformers' config class of the family (Llama's follow the heads)
            # (an explicit null: the query heads, for every family)
            num_kv = int(cfg.get("num_key_value_heads") or num_heads
                         if "num_key_value_heads" in cfg or family == "llama" else QWEN_DEFAULTS["num_key_value_heads"])
            qwen3_default = family == "qwen3" and "head_dim" not in cfg
            head_dim = int(cfg.get("head_dim") or (QWEN_DEFAULTS["head_dim"] if qwen3_default else hidden // num_heads))
            n_layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
            inter = int(cfg["intermediate_size"])
        except KeyError as e:
            raise ConfigError(f"config.json is missing required key {e.args[0]!r}") from None
        if num_heads % num_kv:
            raise ConfigError(
                f"num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv}"
            )
        _check_unported_math(cfg, family, n_layers)

        # Published checkpoints: rope_theta at top level + rope_scaling dict.
        # Recent transformers: rope_parameters holding both.
        rope_params = cfg.get("rope_parameters") or {}
        if (isinstance(rope_params, Mapping) and "rope_type" not in rope_params and len(rope_params) == 1
                and isinstance(next(iter(rope_params.values())), Mapping)):
            # per-layer-type form {"full_attention": {...}}; take the only entry
            rope_params = next(iter(rope_params.values()))
        scaling_dict = cfg.get("rope_scaling") or None
        if scaling_dict is None and rope_params:
            scaling_dict = rope_params
        rope_scaling = None
        if scaling_dict and not isinstance(scaling_dict, Mapping):
            raise ConfigError(f"config.json: rope_scaling / rope_parameters must be an object with a rope_type, got "
                              f"{scaling_dict!r}; fix the config or remove the key")
        # transformers' order: the RoPE dict's own rope_theta, then the top level's (a stale top-level value
        # beside rope_parameters, or a legacy rope_scaling holding the theta, changed the model by 0.1 in logits)
        rope_theta = float((scaling_dict or {}).get("rope_theta") or cfg.get("rope_theta") or 10000.0)
        if scaling_dict:
            rtype = scaling_dict.get("rope_type", scaling_dict.get("type", "default"))
            if rtype == "llama3":
                rope_scaling = RopeScaling(
                    factor=float(scaling_dict["factor"]),
                    low_freq_factor=float(scaling_dict["low_freq_factor"]),
                    high_freq_factor=float(scaling_dict["high_freq_factor"]),
                    # transformers' order: a top-level original_max_position_embeddings (Phi-3's place), the
                    # RoPE dict's, then max_position_embeddings
                    original_max_position_embeddings=int(
                        cfg.get("original_max_position_embeddings")
                        or scaling_dict.get("original_max_position_embeddings")
                        or _context_length(cfg, family)
                    ),
                )
            elif rtype not in ("default", None):
                key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
                raise ConfigError(
                    f"config.json: {key} has rope_type {rtype!r}, which hetero-jax does not implement (supported: "
                    f"'default', 'llama3'); its logits would differ from transformers'. Use a checkpoint with one "
                    "of those RoPE types"
                )

        eos = cfg.get("eos_token_id")
        if eos is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos, (list, tuple)):
            eos_ids = tuple(int(e) for e in eos)
        else:
            eos_ids = (int(eos),)

        if family == "llama":
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
            mlp_bias = bool(cfg.get("mlp_bias", False))
        elif family == "qwen2":
            qkv_bias, o_bias, mlp_bias = True, False, False
        else:  # qwen3
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
            mlp_bias = False

        return cls(
            architecture=family,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=n_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_context_length(cfg, family),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=family == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hf_architecture=hf_arch,
        )

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "ModelConfig":
        path = os.fspath(path)
        return cls.from_hf_dict(read_json(path, ConfigError, missing=f"config file not found: {path}",
                                          fix="pass an HF config.json"))

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF-style config.json dict that round-trips through ``from_hf_dict``."""
        d: dict[str, Any] = {
            "architectures": [self.hf_architecture],
            "model_type": {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.architecture == "llama":
            d["attention_bias"] = self.qkv_bias
            d["mlp_bias"] = self.mlp_bias
        elif self.architecture == "qwen3":
            d["attention_bias"] = self.qkv_bias
        if self.rope_scaling is not None:
            d["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        return d

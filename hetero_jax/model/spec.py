"""The one spec of parameter names and shapes.

It drives random init (tests), checkpoint loading (shape checks), the HF and
GGUF converters (name mapping and shape checks) and sharding (the logical
axes of every parameter and cache field, mapped onto a device mesh by
``hetero_jax.model.sharding``).

Our layout: ``params = {"embed": [V, H], "final_norm": [H], "lm_head": [H, V]
(absent when tied), "layers": [layer_0, ...]}`` where each layer is a flat dict.
Linear weights are stored as ``[in, out]`` (``x @ W``), i.e. transposed with
respect to PyTorch's ``[out, in]``.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from hetero_jax.model.config import ModelConfig


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one decoder layer's parameters."""
    H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nq, nkv = cfg.num_heads * D, cfg.num_kv_heads * D
    s: dict[str, tuple[int, ...]] = {
        "attn_norm": (H,),
        "q_proj": (H, nq),
        "k_proj": (H, nkv),
        "v_proj": (H, nkv),
        "o_proj": (nq, H),
        "mlp_norm": (H,),
        "gate_proj": (H, I),
        "up_proj": (H, I),
        "down_proj": (I, H),
    }
    if cfg.qkv_bias:
        s.update(q_bias=(nq,), k_bias=(nkv,), v_bias=(nkv,))
    if cfg.o_bias:
        s["o_bias"] = (H,)
    if cfg.mlp_bias:
        s.update(gate_bias=(I,), up_bias=(I,), down_bias=(H,))
    if cfg.qk_norm:
        s.update(q_norm=(D,), k_norm=(D,))
    return s


# Logical axes of each per-layer parameter, one name per dimension. ``hetero_jax.model.sharding.RULES`` maps a
# name to a mesh axis: "heads" / "kv_heads" / "mlp" split tensor-parallel (Megatron: q, k, v, gate and up
# by output column, o and down by input row), "vocab" splits the embedding table and the LM head.
_LAYER_AXES: dict[str, tuple[str, ...]] = {
    "attn_norm": ("embed",),
    "q_proj": ("embed", "heads"),
    "k_proj": ("embed", "kv_heads"),
    "v_proj": ("embed", "kv_heads"),
    "o_proj": ("heads", "embed"),
    "mlp_norm": ("embed",),
    "gate_proj": ("embed", "mlp"),
    "up_proj": ("embed", "mlp"),
    "down_proj": ("mlp", "embed"),
    "q_bias": ("heads",),
    "k_bias": ("kv_heads",),
    "v_bias": ("kv_heads",),
    "o_bias": ("embed",),
    "gate_bias": ("mlp",),
    "up_bias": ("mlp",),
    "down_bias": ("embed",),
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
}

# The cache's arrays declare their logical axes where they are declared (``axes_field`` on each field of the
# cache's records and of every policy's per-layer state), and :func:`tree_axes` reads them: the sharding rules
# (``hetero_jax.model.sharding``), the pool and the kernels read one declaration, never a field's name.
AXES_KEY = "axes"


def axes_field(*axes: str, **kwargs):
    """A ``flax.struct`` pytree field holding an array whose dimensions have the logical ``axes`` (one name
    per dimension, as ``param_axes``; "batch" and "kv_heads" split over the mesh)."""
    from flax import struct

    return struct.field(pytree_node=True, metadata={AXES_KEY: tuple(axes)}, **kwargs)


def field_axes(record_type, name: str) -> tuple[str, ...]:
    """The logical axes a record type declares for its field ``name`` (``axes_field``)."""
    import dataclasses

    return tuple(next(f for f in dataclasses.fields(record_type) if f.name == name).metadata[AXES_KEY])


def tree_axes(tree) -> list[tuple[str, ...]]:
    """The logical axes of every array leaf of ``tree`` (records whose fields are ``axes_field``s, tuples,
    lists, None), in ``jax.tree.leaves(tree)`` order: one tuple of names per leaf.

    A leaf reached without a declaration raises ValueError naming the field: no axis is ever guessed from a
    name or a shape."""
    import dataclasses

    import jax

    out: list[tuple[str, ...]] = []

    def walk(node, axes, where):
        if node is None:
            return
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            for f in dataclasses.fields(node):
                if f.metadata.get("pytree_node", True):
                    walk(getattr(node, f.name), f.metadata.get(AXES_KEY), f"{where}.{f.name}")
            return
        if isinstance(node, (tuple, list)):
            for i, x in enumerate(node):
                walk(x, axes, f"{where}[{i}]")
            return
        if axes is None:
            raise ValueError(f"{where}: an array without declared logical axes (declare its field with "
                             "hetero_jax.model.spec.axes_field)")
        if len(axes) != len(getattr(node, "shape", ())):
            raise ValueError(f"{where}: declared axes {axes} do not match its shape {tuple(node.shape)}")
        out.append(tuple(axes))

    walk(tree, None, type(tree).__name__)
    n = len(jax.tree.leaves(tree))
    if n != len(out):
        raise ValueError(f"{type(tree).__name__}: {n} array leaves but {len(out)} declared (a container that "
                         "tree_axes does not walk: use records, tuples or lists)")
    return out


def param_axes(cfg: ModelConfig) -> dict:
    """Nested dict (same structure as params) of logical axis names, one per dimension."""
    top: dict = {
        "embed": ("vocab", "embed"),
        "final_norm": ("embed",),
        "layers": [{name: _LAYER_AXES[name] for name in layer} for layer in param_shapes(cfg)["layers"]],
    }
    if not cfg.tie_word_embeddings:
        top["lm_head"] = ("embed", "vocab")
    return top


def param_shapes(cfg: ModelConfig) -> dict:
    """Nested dict (same structure as params) of shape tuples."""
    top: dict = {
        "embed": (cfg.vocab_size, cfg.hidden_size),
        "final_norm": (cfg.hidden_size,),
        "layers": [layer_shapes(cfg) for _ in range(cfg.num_layers)],
    }
    if not cfg.tie_word_embeddings:
        top["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
    return top


# Our per-layer name -> (HF name suffix under ``model.layers.{i}.``, transpose?)
_HF_LAYER_NAMES: dict[str, tuple[str, bool]] = {
    "attn_norm": ("input_layernorm.weight", False),
    "q_proj": ("self_attn.q_proj.weight", True),
    "k_proj": ("self_attn.k_proj.weight", True),
    "v_proj": ("self_attn.v_proj.weight", True),
    "o_proj": ("self_attn.o_proj.weight", True),
    "q_bias": ("self_attn.q_proj.bias", False),
    "k_bias": ("self_attn.k_proj.bias", False),
    "v_bias": ("self_attn.v_proj.bias", False),
    "o_bias": ("self_attn.o_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "gate_proj": ("mlp.gate_proj.weight", True),
    "up_proj": ("mlp.up_proj.weight", True),
    "down_proj": ("mlp.down_proj.weight", True),
    "gate_bias": ("mlp.gate_proj.bias", False),
    "up_bias": ("mlp.up_proj.bias", False),
    "down_bias": ("mlp.down_proj.bias", False),
}


def hf_tensor_map(cfg: ModelConfig) -> Iterator[tuple[str, tuple, tuple[int, ...], bool]]:
    """Yield ``(hf_name, our_path, hf_shape, transpose)`` for every expected tensor.

    ``our_path`` is a tuple key path into params, e.g. ``("layers", 3, "q_proj")``.
    ``hf_shape`` is the shape as stored by PyTorch (``[out, in]`` for linears).
    """
    shapes = param_shapes(cfg)
    yield "model.embed_tokens.weight", ("embed",), shapes["embed"], False
    yield "model.norm.weight", ("final_norm",), shapes["final_norm"], False
    if "lm_head" in shapes:
        yield "lm_head.weight", ("lm_head",), shapes["lm_head"][::-1], True
    for i, layer in enumerate(shapes["layers"]):
        for name, shape in layer.items():
            suffix, transpose = _HF_LAYER_NAMES[name]
            hf_shape = shape[::-1] if transpose else shape
            yield f"model.layers.{i}.{suffix}", ("layers", i, name), hf_shape, transpose


def init_params(cfg: ModelConfig, seed: int = 0, dtype=np.float32, scale: float = 0.02) -> dict:
    """Random parameters with the spec's shapes (for tests and synthetic benchmarks)."""
    rng = np.random.default_rng(seed)

    def make(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name.endswith("norm"):
            return (1.0 + 0.1 * rng.standard_normal(shape)).astype(dtype)
        return (scale * rng.standard_normal(shape)).astype(dtype)

    shapes = param_shapes(cfg)
    out: dict = {k: make(k, v) for k, v in shapes.items() if k != "layers"}
    out["layers"] = [{k: make(k, v) for k, v in layer.items()} for layer in shapes["layers"]]
    return out


def check_params(cfg: ModelConfig, params: dict) -> None:
    """Raise CheckpointError naming the first missing, unexpected or misshapen tensor."""
    from hetero_jax.errors import CheckpointError

    shapes = param_shapes(cfg)
    for key in set(shapes) | set(params):
        if key not in params:
            raise CheckpointError(f"checkpoint is missing tensor {key!r}")
        if key not in shapes:
            raise CheckpointError(f"checkpoint has unexpected tensor {key!r}")
    if len(params["layers"]) != cfg.num_layers:
        raise CheckpointError(
            f"checkpoint has {len(params['layers'])} layers, config says {cfg.num_layers}"
        )
    for key, shape in shapes.items():
        if key == "layers":
            continue
        if tuple(params[key].shape) != shape:
            raise CheckpointError(
                f"tensor {key!r} has shape {tuple(params[key].shape)}, expected {shape}"
            )
    for i, (layer, lshapes) in enumerate(zip(params["layers"], shapes["layers"])):
        for name in set(layer) | set(lshapes):
            if name not in layer:
                raise CheckpointError(f"checkpoint is missing tensor 'layers.{i}.{name}'")
            if name not in lshapes:
                raise CheckpointError(f"checkpoint has unexpected tensor 'layers.{i}.{name}'")
            if tuple(layer[name].shape) != lshapes[name]:
                raise CheckpointError(
                    f"tensor 'layers.{i}.{name}' has shape {tuple(layer[name].shape)}, "
                    f"expected {lshapes[name]}"
                )

"""Hugging Face safetensors directory -> hetero-jax checkpoint.

Reads ``config.json`` and ``model.safetensors`` (or shards listed by
``model.safetensors.index.json``) one file at a time, checks every tensor name
and shape against ``hetero_jax.model.spec.hf_tensor_map``, transposes linears to our
``[in, out]`` layout, casts to the target dtype and writes with
``save_checkpoint``. Nothing is written unless every check passed.

Tied embeddings: when ``tie_word_embeddings`` is true our params have no
``lm_head``. If the files still carry ``lm_head.weight`` it is dropped when it
equals the embedding, and rejected otherwise: silently discarding a trained
output head would give a different model from the one the files describe.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import numpy as np

from hetero_jax.io.checkpoint import check_output_apart, check_output_dir, np_dtype, save_checkpoint
from hetero_jax.model.config import ModelConfig
from hetero_jax.errors import CheckpointError, ConfigError, read_json
from hetero_jax.model.spec import hf_tensor_map, param_shapes
from hetero_jax.io.tokenizer import (check_chat_template_entry, check_special_tokens, check_token_ids,
                                     checked_chat_template, default_chat_template, json_object, read_chat_template)

# Non-parameter buffers some older checkpoints carry; they are recomputed, never loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class ConversionResult:
    """Summary of one conversion."""

    out_dir: str
    num_tensors: int
    num_params: int
    num_bytes: int
    seconds: float

    @classmethod
    def of(cls, out_dir: str, params: dict, t0: float) -> "ConversionResult":
        """The summary of ``params`` written to ``out_dir`` by a conversion that started at ``t0``."""
        arrays = [v for k, v in params.items() if k != "layers"] + [v for l in params["layers"] for v in l.values()]
        return cls(out_dir=out_dir, num_tensors=len(arrays), num_params=int(sum(a.size for a in arrays)),
                   num_bytes=int(sum(a.nbytes for a in arrays)), seconds=time.perf_counter() - t0)

    def summary(self) -> str:
        return (f"converted {self.num_tensors} tensors ({self.num_params:,} parameters, "
                f"{self.num_bytes:,} bytes) in {self.seconds:.1f} s -> {self.out_dir}")


class ParamBuilder:
    """Collects HF-named tensors ([out, in] for linears) into our params pytree, checking each one."""

    def __init__(self, cfg: ModelConfig, dtype: str, layout_from: str = "config.json"):
        self.cfg, self.layout_from = cfg, layout_from  # what the expected layout was read from, for messages
        self.dtype = np_dtype(dtype)
        self.expected = {hf: (path, tuple(shape), tr) for hf, path, shape, tr in hf_tensor_map(cfg)}
        shapes = param_shapes(cfg)
        self.params: dict = {k: None for k in shapes if k != "layers"}
        self.params["layers"] = [dict.fromkeys(layer) for layer in shapes["layers"]]
        self.found: dict[str, str] = {}  # hf name -> file it came from
        self.planned: dict[str, str] = {}  # hf name -> where it is, from the headers (checked before any read)
        self.tied_lm_head: tuple[np.ndarray, str] | None = None

    def wants(self, name: str) -> bool:
        return name in self.expected

    def check_name_and_shape(self, name: str, shape: tuple[int, ...], where: str) -> bool:
        """Validate before reading the data; False means "skip this tensor"."""
        if name.endswith(_IGNORED_SUFFIXES):
            return False
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return True  # compared with the embedding in finish()
        if name not in self.expected:
            raise CheckpointError(
                f"unexpected tensor {name!r} (shape {tuple(shape)}) in {where}: the {self.cfg.hf_architecture} "
                f"layout from {self.layout_from} has no such tensor; the weights do not match {self.layout_from}")
        if name in self.planned:
            raise CheckpointError(f"tensor {name!r} appears twice: in {self.planned[name]} and in {where}")
        exp = self.expected[name][1]
        if tuple(shape) != exp:
            raise CheckpointError(
                f"tensor {name!r} in {where} has shape {tuple(shape)}, expected {exp} from {self.layout_from}; "
                f"the weights do not match {self.layout_from}")
        self.planned[name] = where
        return True

    def check_complete(self, where: str) -> None:
        """After every tensor's name and shape was checked and before any is read: CheckpointError naming a
        tensor the layout needs that no file holds."""
        self._missing([n for n in self.expected if n not in self.planned], where)

    def _missing(self, missing: list[str], where: str) -> None:
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(
                f"tensor {missing[0]!r}{more} is missing from {where}; expected shape "
                f"{self.expected[missing[0]][1]}. The download is incomplete or the weights do not match "
                f"{self.layout_from}")

    def add(self, name: str, array: np.ndarray, where: str) -> None:
        """``array`` in the HF layout; checked with ``check_name_and_shape`` first."""
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            self.tied_lm_head = (np.asarray(array), where)
            return
        path, _, transpose = self.expected[name]
        a = np.asarray(array)
        if transpose:
            a = a.T
        a = np.ascontiguousarray(a.astype(self.dtype, copy=False))
        if len(path) == 1:
            self.params[path[0]] = a
        else:
            self.params["layers"][path[1]][path[2]] = a
        self.found[name] = where

    def finish(self, where: str) -> dict:
        self._missing([n for n in self.expected if n not in self.found], where)
        if self.tied_lm_head is not None:
            head, head_where = self.tied_lm_head
            embed = self.params["embed"]
            if head.shape != embed.shape or not np.array_equal(head.astype(self.dtype), embed):
                raise CheckpointError(
                    f"config.json sets tie_word_embeddings=true but lm_head.weight in {head_where} differs from "
                    "model.embed_tokens.weight; set tie_word_embeddings to false in config.json to keep the "
                    "separate output head")
        return self.params


def _list_safetensors(hf_dir: str) -> list[tuple[str, set[str] | None]]:
    """``[(file, names expected in it or None)]``: shards from the index, else model.safetensors."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not a mapping of tensor names to file names")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is corrupt ({type(e).__name__}: {e}); re-download it") from None
        by_file: dict[str, set[str]] = {}
        for name, fname in weight_map.items():
            by_file.setdefault(fname, set()).add(name)
        out = []
        for fname in sorted(by_file):
            p = os.path.join(hf_dir, fname)
            if not os.path.isfile(p):
                raise CheckpointError(f"shard {p} listed in {index} is missing; re-download it")
            out.append((p, by_file[fname]))
        return out
    single = os.path.join(hf_dir, "model.safetensors")
    if os.path.isfile(single):
        return [(single, None)]
    others = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    if len(others) == 1:
        return [(os.path.join(hf_dir, others[0]), None)]
    if others:
        raise CheckpointError(
            f"{hf_dir} has several .safetensors files but no model.safetensors.index.json; re-download the index")
    raise CheckpointError(
        f"no model.safetensors or model.safetensors.index.json in {hf_dir}; only safetensors checkpoints are "
        "supported (re-save PyTorch .bin weights with save_pretrained(..., safe_serialization=True))")


_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})  # safetensors dtype names the converter reads


def _corrupt(path: str, e: BaseException) -> CheckpointError:
    return CheckpointError(
        f"{path} is truncated or corrupt ({type(e).__name__}: {e}); re-download it")


def read_hf_config(hf_dir: str) -> tuple[ModelConfig, dict]:
    """``(ModelConfig, raw config.json dict)`` with clear errors for a missing dir or file."""
    if not os.path.isdir(hf_dir):
        what = "is a file, not a directory (for a GGUF file use --gguf FILE)" if os.path.exists(hf_dir) \
            else "does not exist"
        raise CheckpointError(f"HF model directory {hf_dir} {what}")
    raw = read_json(os.path.join(hf_dir, "config.json"), ConfigError,
                    missing=f"no config.json in {hf_dir}; is this a Hugging Face model directory?",
                    fix="re-download it")
    return ModelConfig.from_hf_dict(raw), raw


def convert_hf(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "float32",
               force: bool = False, progress: bool = True) -> ConversionResult:
    """Convert an HF Llama/Qwen2/Qwen3 safetensors directory into a hetero-jax checkpoint at ``out_dir``."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    hf_dir = os.path.abspath(os.fspath(hf_dir))
    np_dtype(dtype)  # validate early
    check_output_apart(hf_dir, out_dir)
    out_dir = check_output_dir(out_dir, force)
    cfg, raw_cfg = read_hf_config(hf_dir)
    quant = raw_cfg.get("quantization_config")
    if quant:  # FP8, GPTQ, AWQ, bitsandbytes: packed or scaled tensors this converter does not dequantise
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
        raise ConfigError(f"{os.path.join(hf_dir, 'config.json')} has a quantization_config (quant_method "
                          f"{method!r}): quantised checkpoints are not supported; convert the unquantised release "
                          "of the model (bfloat16, float16 or float32)")
    if not os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        raise CheckpointError(
            f"no tokenizer.json in {hf_dir}; hetero-jax needs the HF tokenizers file (download it with the weights)")
    files = _list_safetensors(hf_dir)
    tok_files = _tokenizer_files(hf_dir)  # read (and checked) before the weights, not after

    def opened(path):
        try:
            return safe_open(path, framework="numpy")
        except Exception as e:  # SafetensorError / OSError on a short or garbled file
            raise _corrupt(path, e) from None

    # Pass 1, headers only: every file's names, shapes and dtypes, and the tensors none holds, are checked
    # before any tensor is read (a 70B model's shards are tens of GB).
    builder = ParamBuilder(cfg, dtype)
    plan: list[tuple[str, list[str]]] = []
    for path, listed in files:
        with opened(path) as f:
            names = list(f.keys())
            if listed is not None and set(names) != listed:
                diff = sorted(listed ^ set(names))
                raise CheckpointError(
                    f"{path} does not hold the tensors model.safetensors.index.json lists for it "
                    f"(e.g. {diff[0]!r}); re-download the checkpoint")
            keep = []
            for name in names:
                try:
                    sl = f.get_slice(name)
                    shape, kind = tuple(sl.get_shape()), sl.get_dtype()
                except Exception as e:
                    raise _corrupt(path, e) from None
                if not builder.check_name_and_shape(name, shape, path):
                    continue
                if kind not in _FLOAT_DTYPES:
                    raise CheckpointError(
                        f"tensor {name!r} in {path} has dtype {kind}: quantised weights are not supported; "
                        "convert the unquantised release of the model (bfloat16, float16 or float32)")
                keep.append(name)
        plan.append((path, keep))
    builder.check_complete(hf_dir)

    bar = tqdm(total=len(builder.expected), unit="tensor", desc="converting", disable=not progress)
    try:
        for path, keep in plan:
            with opened(path) as f:
                for name in keep:
                    try:
                        arr = f.get_tensor(name)
                    except Exception as e:
                        raise _corrupt(path, e) from None
                    builder.add(name, arr, path)
                    if builder.wants(name):
                        bar.update(1)
        params = builder.finish(hf_dir)
    finally:
        bar.close()

    source: dict[str, Any] = {"type": "hf", "path": hf_dir, "files": [os.path.basename(p) for p, _ in files]}
    out = save_checkpoint(out_dir, cfg, params, tokenizer_dir_or_files=tok_files,
                          meta={"source": source}, force=force, hf_config=raw_cfg)
    return ConversionResult.of(out, params, t0)


def _tokenizer_files(hf_dir: str) -> dict[str, Any]:
    """Tokenizer files to copy, each checked as ``Tokenizer.from_dir`` reads it (a file that converts and then
    fails every load is refused here, before any weight is read); tokenizer_config.json gets the chat template
    that wins (chat_template.jinja's, when there is one, as in transformers) inlined."""
    from hetero_jax.io.checkpoint import TOKENIZER_FILES

    fix = "re-download it"
    where = {n: os.path.join(hf_dir, n) for n in TOKENIZER_FILES}
    files: dict[str, Any] = {}
    for n, p in where.items():
        if os.path.isfile(p):
            with open(p, "rb") as f:
                files[n] = f.read()
    tc_name = "tokenizer_config.json"
    tc = json_object(where[tc_name], fix, files[tc_name]) if tc_name in files else {}
    check_chat_template_entry(tc.get("chat_template"), where[tc_name], fix)
    check_special_tokens(tc, where[tc_name], fix)
    if "chat_template.jinja" in files:
        tc["chat_template"] = read_chat_template(where["chat_template.jinja"], fix, files["chat_template.jinja"])
        checked_chat_template(tc["chat_template"], where["chat_template.jinja"], where["chat_template.jinja"],
                              converting=True)
    else:  # a string, or HF's named templates, whose "default" is the chat template (the loader's rule)
        source, _ = default_chat_template(tc.get("chat_template"))
        if source:
            checked_chat_template(source, f"{where[tc_name]}'s chat_template", f"chat_template in {where[tc_name]}",
                                  converting=True)
    files[tc_name] = tc
    if "special_tokens_map.json" in files:
        check_special_tokens(json_object(where["special_tokens_map.json"], fix, files["special_tokens_map.json"]),
                             where["special_tokens_map.json"], fix)
    if "generation_config.json" in files:
        gen = "generation_config.json"
        check_token_ids(json_object(where[gen], fix, files[gen]), where[gen], fix)
    _check_tokenizer_json(where["tokenizer.json"], files.get("tokenizer.json", b""))
    return files


def _check_tokenizer_json(path: str, content: bytes) -> None:
    """Refuse a tokenizer.json the tokenizers library cannot read (the conversion would succeed and every
    load of the checkpoint fail)."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_str(content.decode("utf-8"))
    except Exception as e:  # UnicodeDecodeError, or the library's own Exception on bad JSON / a bad model
        raise CheckpointError(f"{path} is corrupt or not an HF tokenizers file ({str(e)[:200]}); "
                              "re-download it") from None

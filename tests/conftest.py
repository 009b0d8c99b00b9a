"""Shared pytest fixtures."""

from __future__ import annotations

import contextlib
import io
import os

import pytest


def pytest_collection_modifyitems(items):
    """Tests marked slow run first. pytest-xdist hands tests out in this order, so each long one starts while
    short ones are left to fill the other worker, instead of a long one starting last beside an idle worker."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> str:
    """Converted SmolLM2-135M checkpoint dir (converted once per session, or reused from $HETERO_JAX_CACHE).

    Leaves HETERO_JAX_CACHE pointing at that cache for the whole session so that
    ``hetero_jax.io.hub.load("smollm2-135m")`` in any test reuses the same conversion.
    """
    from hetero_jax.io import hub

    prev = os.environ.get("HETERO_JAX_CACHE")
    if not prev:
        os.environ["HETERO_JAX_CACHE"] = str(tmp_path_factory.mktemp("hetero_jax_cache"))
    try:
        yield hub.ensure_converted("smollm2-135m", progress=False)
    finally:
        if prev is None:
            os.environ.pop("HETERO_JAX_CACHE", None)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: ``tiny_checkpoint(arch)`` -> (HF dir, our converted dir) for a tiny random model.

    The HF dir is written by transformers (safetensors) and converted with our CLI, once per arch.
    """
    from hf_fixtures import make_tiny_hf
    from convert.cli import main as convert_main

    made: dict = {}

    def get(arch: str):
        if arch not in made:
            root = tmp_path_factory.mktemp(f"tiny_{arch}")
            out = root / "converted"
            # the writers' progress bars and "converted ..." line would otherwise land in the captured output of
            # whichever test first asks for this arch
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                hf_dir = make_tiny_hf(arch, root / "hf")
                assert convert_main([str(hf_dir), str(out)]) == 0
            made[arch] = (str(hf_dir), str(out))
        return made[arch]

    return get


# The tiny Llama of ``tiny_checkpoint``, for the tests that damage a copy of it (conversion and loading errors).
@pytest.fixture(scope="session")
def base_hf(tiny_checkpoint):
    """The tiny Llama HF dir (shared: never modified; ``hf`` is a copy to damage)."""
    from pathlib import Path

    return Path(tiny_checkpoint("llama")[0])


@pytest.fixture(scope="session")
def converted(tiny_checkpoint):
    """``base_hf`` converted by our CLI (shared: never modified; copy it to damage it)."""
    from pathlib import Path

    return Path(tiny_checkpoint("llama")[1])


@pytest.fixture
def hf(base_hf, tmp_path):
    """A private copy of the tiny Llama HF dir to damage."""
    import shutil

    return shutil.copytree(base_hf, tmp_path / "hf")


@pytest.fixture
def no_weights_read(monkeypatch):
    """Fail if a safetensors file is opened: input refused before the conversion reads any weight."""
    import safetensors

    def boom(*a, **k):
        raise AssertionError("weights were read for input that should have been refused first")
    monkeypatch.setattr(safetensors, "safe_open", boom)


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own GGUF loader on the embedded SmolLM2 file: (model float32 eval, tokenizer).

    Loaded once per session (dequantising in transformers takes most of a minute).
    """
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hetero_jax.io.gguf import smollm2_gguf_path

    path = smollm2_gguf_path()
    d, f = os.path.dirname(path), os.path.basename(path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(d, gguf_file=f)


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """Our loaded SmolLM2-135M bundle (float32), loaded once per session."""
    import hetero_jax

    return hetero_jax.load(smollm2_dir)


@pytest.fixture
def verified_triton_modules(monkeypatch):
    """Run the MLIR verifier on every Triton module the CUDA lowering builds (tests without a GPU): the list
    of each module's verify() result."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    orig = reg.lowering.lower_jaxpr_to_triton_module
    results = []

    def wrapped(*args, **kwargs):
        res = orig(*args, **kwargs)
        results.append(res.module.operation.verify())
        return res

    monkeypatch.setattr(reg.lowering, "lower_jaxpr_to_triton_module", wrapped)
    return results


def lower_cuda(f, *args) -> str:
    """The StableHLO text of ``f`` lowered for CUDA, on a machine without a GPU."""
    import jax

    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.fixture
def no_compute(monkeypatch):
    """Fail if any model compute starts (prefill, decode step, session extend): bad input must be refused
    before."""
    from hetero_jax.model import transformer as M

    def boom(*a, **k):
        raise AssertionError("compute started for input that should have been refused")
    for name in ("prefill", "decode_step", "extend"):
        monkeypatch.setattr(M, name, boom)


@pytest.fixture(scope="session")
def tokenizer(request):
    """SmolLM2's tokenizer alone (no weights): from the converted cache, or the suite's conversion."""
    from hetero_jax.io import hub
    from hetero_jax.io.checkpoint import is_checkpoint
    from hetero_jax.io.tokenizer import Tokenizer

    path = os.path.join(hub.cache_dir(), "smollm2-135m")
    if not is_checkpoint(path):
        path = request.getfixturevalue("smollm2_dir")
    return Tokenizer.from_dir(path)

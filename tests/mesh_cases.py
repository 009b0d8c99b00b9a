"""Sharded runs on 6 simulated CPU devices, each against the same run on one device.

Collected only by ``tests/test_mesh.py``, which starts pytest on this file in a fresh process with
``XLA_FLAGS=--xla_force_host_platform_device_count=6`` (the flag must be set before JAX starts).
"""

import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import hetero_jax
from hetero_jax.runtime import Engine, Session
from hetero_jax.io.hub import place
from hetero_jax.policies import (CAKE, H2O, REGISTRY, ContextKeeper, FreeKV, FullKV, HCAttention, HeteroCache,
                                 PolicyError, ProfiledSnapKV, PyramidKV, Quest, SnapKV, StreamingLLM, SyncKV)
from hetero_jax.model.cache import POOL_QUANTUM, prompt_arrays
from hetero_jax.model.sharding import MeshError, cache_shardings, keep_placed, make_mesh, per_device_bytes
from hetero_jax.runtime.compile_cache import cached_executables
from test_contextkeeper import RANKING
from test_heterocache import COPY_PROFILE, PROFILE
from test_synckv import PROFILE as SYNC_PROFILE
from tiny_model import greedy_with_logits, tiny_model

pytestmark = pytest.mark.skipif(jax.device_count() < 6, reason="needs 6 devices (run through tests/test_mesh.py)")

MODEL = tiny_model()
RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(3, 100, 150).tolist(), RNG.integers(3, 100, 110).tolist()]
POLICIES = {"full": FullKV(), "snapkv": SnapKV(budget=0.7), "heterocache": HeteroCache(profile=PROFILE, budget=0.5)}
_SINGLE: dict = {}


def single(name):
    if name not in _SINGLE:
        _SINGLE[name] = greedy_with_logits(MODEL, POLICIES[name], PROMPTS, steps=8)
    return _SINGLE[name]


def spec_of(x):
    """The PartitionSpec as a tuple with one entry per dimension (None = whole)."""
    spec = tuple(x.sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


@pytest.mark.parametrize("tp,dp", [(3, 1), (1, 2), (3, 2)])
@pytest.mark.parametrize("name", list(POLICIES))
def test_greedy_and_logits_equal_one_device(name, tp, dp):
    toks, logits, _ = single(name)
    sharded = place(MODEL, make_mesh(tp, dp))
    got_toks, got_logits, eng = greedy_with_logits(sharded, POLICIES[name], PROMPTS, steps=8)
    np.testing.assert_array_equal(got_toks, toks)
    np.testing.assert_allclose(got_logits, logits, atol=1e-4, rtol=0)

    # every cache leaf sits where the spec says, after prefill and 8 donated decode steps
    want = jax.tree.leaves(cache_shardings(eng.cache, sharded.mesh))
    for leaf, w in zip(jax.tree.leaves(eng.cache), want):
        assert leaf.sharding.is_equivalent_to(w, leaf.ndim), (leaf.shape, leaf.sharding, w)
    data = "data" if dp > 1 else None
    model = "model" if tp > 1 else None
    # one pool per device: [B, S, P, D] split over "data" (batch) and "model" (S = tp shards of the heads)
    pool = eng.cache.pool
    assert pool.num_shards == tp
    assert spec_of(pool.k) == spec_of(pool.v) == (data, model, None, None)
    assert spec_of(pool.positions) == (data, model, None)
    assert all(spec_of(l.offsets) == spec_of(l.lengths) == (data, model) for l in eng.cache.layers)
    assert spec_of(eng.cache.seq_lens) == (data,) and spec_of(eng.cache.tail_lens) == (data,)
    kv_dev = per_device_bytes(prompt_arrays(eng.cache))
    assert len(kv_dev) == tp * dp
    total = sum(a.nbytes for a in prompt_arrays(eng.cache))
    assert set(kv_dev.values()) == {total // (tp * dp)}  # every array splits exactly: nothing replicated
    # each shard allocates its own heads' regions (kept rows + tail rows each, layer after layer), the
    # largest (sequence, shard) total rounded up to the pool quantum: no head is padded to another's size
    cfg = MODEL.config
    lengths = np.stack([np.asarray(l.lengths) for l in eng.cache.layers])  # [L, B, H]
    per_shard = (lengths + eng.cache.tail_capacity).reshape(cfg.num_layers, len(PROMPTS), tp, -1).sum(axis=(0, 3))
    assert pool.num_rows == -(-int(per_shard.max()) // POOL_QUANTUM) * POOL_QUANTUM
    item = 2 * cfg.head_dim * pool.k.dtype.itemsize
    assert kv_dev[next(iter(kv_dev))] == pool.num_rows * item * len(PROMPTS) // dp
    if name == "heterocache" and tp > 1:
        # role-balanced rows (one head per shard): each shard keeps about the same prompt rows, well below a
        # full cache's share (the pool adds each head's tail rows and the quantum's rounding, checked above)
        assert eng.policy.head_tp == tp
        full_per_device = max(len(p) for p in PROMPTS) * cfg.num_kv_heads * cfg.num_layers // tp
        kept = lengths.reshape(cfg.num_layers, len(PROMPTS), tp, -1).sum(axis=(0, 3))  # [B, tp]
        assert kept.max() < 0.8 * full_per_device, (kept, full_per_device)
        host = eng.state.host_arrays()
        assert host and all(a.sharding.memory_kind == "pinned_host" for a in host)
        # the host copy is split like the device cache: each device's host holds its own heads' share
        assert set(per_device_bytes(host).values()) == {sum(a.nbytes for a in host) // (tp * dp)}
        assert eng.state.host_bytes_by_role()["full"] > 0
        p = eng.state.stats()["placement"]  # the stats say what the placement bought
        assert p["tp"] == tp and p["pool_rows_per_shard"] == pool.num_rows * len(PROMPTS)
        # like with like: the prompt's tokens, the pool's tail rows left out of both
        prompt_rows = lengths.reshape(cfg.num_layers, len(PROMPTS), tp, -1).sum(axis=(0, 3))  # [B, tp]
        assert p["allocated_tokens_per_shard"] == prompt_rows.max() * len(PROMPTS) < p["pool_rows_per_shard"]
        assert p["allocated_tokens_per_shard"] <= p["contiguous_allocated_tokens_per_shard"]
        assert p["kept_max_over_mean"] <= p["contiguous_kept_max_over_mean"]
        assert sum(p["kept_tokens_per_shard"]) == sum(p["contiguous_kept_tokens_per_shard"])
    stats = eng.stats_fields()
    assert stats["kv_bytes_per_device"] and len(stats["kv_bytes_per_device"]) == tp * dp


# every other registered policy, with options under which its decode-time machinery runs on the tiny model:
# Quest in device memory and offloaded and FreeKV (pages recalled from the host between steps), SyncKV's
# refreshes, HCAttention's in-step host sums
PEERS = {
    "streamingllm": StreamingLLM(budget=0.5), "pyramidkv": PyramidKV(budget=0.5), "h2o": H2O(budget=0.5),
    "cake": CAKE(budget=0.5), "contextkeeper": ContextKeeper(ranking=RANKING, budget=0.5, sink=4, recent=8),
    "quest": Quest(budget=0.6, page_size=8, full_layers=1),
    "quest-offload": Quest(budget=0.6, page_size=8, full_layers=1, offload=True),
    "freekv": FreeKV(budget=0.6, page_size=8),
    "synckv": SyncKV(profile=SYNC_PROFILE, budget=0.6, m=3), "hcattention": HCAttention(budget=0.5),
    # per-head budgets from a profile, each head's own row count in its shard
    "profiledsnapkv": ProfiledSnapKV(profile=PROFILE, budget=0.5, window=8),
}
# what each peer's stats must show, so that the mesh run is known to have exercised it
EXERCISED = {"quest-offload": ("pages_recalled",), "freekv": ("pages_recalled",),
             "synckv": ("recalls",), "hcattention": ("host_value_bytes_read_per_step",)}
PEER_STEPS = 6
_PEER_SINGLE: dict = {}


def test_every_registered_policy_has_a_mesh_case():
    """README "Several devices": every policy runs on a mesh; a newly registered one needs its case here."""
    covered = {type(p).name for p in (*POLICIES.values(), *PEERS.values())}
    assert covered == set(REGISTRY), set(REGISTRY) ^ covered


def _stats(eng) -> dict:
    """The decode state's counters, without wall-clock ones (they differ from run to run)."""
    return {k: v for k, v in eng.state.stats().items() if "seconds" not in k and not k.endswith("_ms_per_step")}


@pytest.mark.parametrize("tp,dp", [(3, 2)])
@pytest.mark.parametrize("name", list(PEERS))
def test_every_policy_equals_one_device(name, tp, dp):
    """Greedy tokens, logits (1e-4) and the policy's counters (pages fetched, recalled, corrected) on tp 3 x dp 2
    (both axes split; a mesh using 3 of the 6 devices is covered by the first test) equal one device's; every cache leaf
    sits where the spec says after prefill and the decode steps with their host writes (a step that handed the
    cache back placed otherwise was refused by its compiled executable at the next step); host copies are in
    pinned host memory, split over the mesh's devices."""
    policy = PEERS[name]
    if name not in _PEER_SINGLE:
        _PEER_SINGLE[name] = greedy_with_logits(MODEL, policy, PROMPTS, steps=PEER_STEPS)
    toks, logits, one = _PEER_SINGLE[name]
    got_toks, got_logits, eng = greedy_with_logits(place(MODEL, make_mesh(tp, dp)), policy, PROMPTS, steps=PEER_STEPS)
    np.testing.assert_array_equal(got_toks, toks)
    np.testing.assert_allclose(got_logits, logits, atol=1e-4, rtol=0)
    assert _stats(eng) == _stats(one)
    for key in EXERCISED.get(name, ()):
        assert _stats(one)[key] > 0, (name, key, _stats(one))
    # every leaf, the policy state's included, as its record declares (state that does not lead with the batch
    # stays whole by its declaration)
    for leaf, w in zip(jax.tree.leaves(eng.cache), jax.tree.leaves(cache_shardings(eng.cache, eng.model.mesh))):
        assert leaf.sharding.is_equivalent_to(w, leaf.ndim), (leaf.shape, leaf.sharding, w)
    assert eng.cache.pool.num_shards == tp and spec_of(eng.cache.pool.k) == ("data" if dp > 1 else None, "model",
                                                                               None, None)
    host = eng.state.host_arrays()
    assert bool(host) == (name in EXERCISED)
    assert all(a.sharding.memory_kind == "pinned_host" for a in host)
    assert not host or len(per_device_bytes(host)) == tp * dp


def test_hcattention_callback_sums_equal_one_device(monkeypatch):
    """HCAttention's host sums through the callback a GPU backend uses (``sums_in_step`` faked False; each device
    sums its own heads from its shard of the store) give the tokens and logits of its in-step sums on one device."""
    from hetero_jax.policies.hcattention import decode as hc_decode

    name = "hcattention"
    if name not in _PEER_SINGLE:
        _PEER_SINGLE[name] = greedy_with_logits(MODEL, PEERS[name], PROMPTS, steps=PEER_STEPS)
    toks, logits, one = _PEER_SINGLE[name]
    assert one.state.stats()["host_sums"] == "in_step"
    monkeypatch.setattr(hc_decode, "sums_in_step", lambda: False)
    got_toks, got_logits, eng = greedy_with_logits(place(MODEL, make_mesh(3, 2)), PEERS[name], PROMPTS,
                                                   steps=PEER_STEPS)
    assert eng.state.stats()["host_sums"] == "callback" and eng.state.stats()["callback_ms_per_step"] > 0
    np.testing.assert_array_equal(got_toks, toks)
    np.testing.assert_allclose(got_logits, logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("tp,dp", [(3, 1), (1, 2), (3, 2)])
def test_hcattention_callback_counters_equal_one_device(monkeypatch, tp, dp):
    """On the callback path every device's call counted: a session's turn_callbacks were multiplied by the devices,
    and with one sequence (the batch repeated over "data") the value rows read by dp (review 93). Counted as one
    device counts: calls of the block at (0, 0), rows of every block once."""
    from hetero_jax.policies.hcattention import decode as hc_decode

    monkeypatch.setattr(hc_decode, "sums_in_step", lambda: False)
    ctx, questions = PROMPTS[0], ([5, 6, 7, 8, 9], [10] * 7)
    counts = []
    for model in (MODEL, place(MODEL, make_mesh(tp, dp))):
        r = hetero_jax.generate(model, ctx, PEERS["hcattention"], max_new_tokens=4, chat=False)
        sess = Session(model, ctx, PEERS["hcattention"], chat=False, reserve_tokens=8)
        turn = [sess.ask(q, max_new_tokens=3) for q in questions][-1]
        ps = r.stats.policy_stats
        counts.append((r.token_ids, ps["host_sums"], ps["host_value_bytes_read_per_step"],
                       r.stats.kv_bytes_read_per_step, turn.token_ids, turn.stats.policy_stats["turn_callbacks"]))
    assert counts[0][1] == "callback" and counts[0][5] > 0
    assert counts[1] == counts[0]


def test_a_step_hands_the_cache_back_placed_as_it_took_it():
    """``keep_placed``, which the decode and extend steps end with: a field that a step's body leaves placed
    otherwise (here the lengths gathered whole) goes back where ``shard_cache`` put it, so the engine's one
    compiled step accepts its own output (FreeKV's state once came back split and the next step failed)."""
    _, _, eng = greedy_with_logits(place(MODEL, make_mesh(3, 2)), FullKV(), PROMPTS, steps=1)
    cache, mesh = eng.cache, eng.model.mesh
    whole = NamedSharding(mesh, PartitionSpec())
    gather = lambda c: c.replace(seq_lens=jax.lax.with_sharding_constraint(c.seq_lens + 1, whole))  # noqa: E731
    assert spec_of(cache.seq_lens) == ("data",) and spec_of(jax.jit(gather)(cache).seq_lens) == (None,)
    out = jax.jit(lambda c: keep_placed(gather(c)))(cache)
    np.testing.assert_array_equal(np.asarray(out.seq_lens), np.asarray(cache.seq_lens) + 1)
    for leaf, w in zip(jax.tree.leaves(out), jax.tree.leaves(cache_shardings(cache, mesh))):
        assert leaf.sharding.is_equivalent_to(w, leaf.ndim), (leaf.shape, leaf.sharding, w)


@pytest.mark.parametrize("name", ["freekv"])
def test_host_fetching_turns_equal_one_device(name):
    """A session turn over the host copy (FreeKV's dense turn attention from the host, the function offloaded
    Quest's turns call too, and its re-selection after it) on tp 3 x dp 2 answers as on one device (one
    sequence: the batch stays whole over "data", and each device's host gather reads its heads of it)."""
    ctx, questions = PROMPTS[0], ([5, 6, 7, 8, 9], [10] * 7)  # one chunk size: one extend executable
    answers = []
    for model in (MODEL, place(MODEL, make_mesh(3, 2))):
        sess = Session(model, ctx, PEERS[name], chat=False, reserve_tokens=8)
        answers.append([sess.ask(q, max_new_tokens=4).token_ids for q in questions])
    assert answers[0] == answers[1]
    if name == "freekv":
        assert sess.engine.state.stats()["turn_reselections"] == 2


@pytest.mark.parametrize("tp,dp", [(3, 1), (1, 2)])
def test_copy_window_on_a_mesh_is_refused_before_compute(tp, dp):
    """HeteroCache's copy window is built for one device; on a mesh it used to be silently off."""
    before = cached_executables()
    with pytest.raises(PolicyError, match=re.escape(
            f"HeteroCache: copy_window=16 runs on one device only, but the model is on a mesh of tp={tp} x dp={dp} "
            "devices; use copy_window=0 (off) on a mesh, or load the model without one")):
        hetero_jax.generate(place(MODEL, make_mesh(tp, dp)), PROMPTS, HeteroCache(profile=COPY_PROFILE, copy_window=16),
                            max_new_tokens=2, chat=False)
    assert cached_executables() == before  # refused before anything was compiled or run


@pytest.mark.parametrize("tp,dp", [(3, 2)])
def test_heterocache_rows_recall_and_turns_equal_one_device(tp, dp):
    """On the row layout, drift recalls (tau_drift > 1: every check drifts) write each satellite's rows into
    its head of its row group, and a session turn re-selects every compressed head there: tokens, logits,
    recall counts and answers equal one device."""
    policy = HeteroCache(profile=PROFILE, budget=0.5, window=2, tau_drift=1.5)
    toks, logits, one = greedy_with_logits(MODEL, policy, PROMPTS, steps=8)
    sharded = place(MODEL, make_mesh(tp, dp))
    got_toks, got_logits, eng = greedy_with_logits(sharded, policy, PROMPTS, steps=8)
    np.testing.assert_array_equal(got_toks, toks)
    np.testing.assert_allclose(got_logits, logits, atol=1e-4, rtol=0)
    assert one.state.stats()["recalls"] > 0
    assert eng.state.stats()["recalls"] == one.state.stats()["recalls"]
    assert eng.state.stats()["bytes_recalled"] == one.state.stats()["bytes_recalled"]

    ctx, questions = PROMPTS[0], (RNG.integers(3, 100, 9).tolist(), RNG.integers(3, 100, 21).tolist())
    answers = []
    for model in (MODEL, sharded):
        sess = Session(model, ctx, HeteroCache(profile=PROFILE, budget=0.5), chat=False, reserve_tokens=8)
        answers.append([sess.ask(q, max_new_tokens=5).token_ids for q in questions])
        assert sess.engine.state.stats()["reselections"] == 2
    assert answers[0] == answers[1]


def test_params_split_tensor_parallel():
    sharded = place(MODEL, make_mesh(3, 2))
    layer = sharded.params["layers"][0]
    assert spec_of(layer["q_proj"]) == (None, "model")
    assert spec_of(layer["k_proj"]) == (None, "model")
    assert spec_of(layer["o_proj"]) == ("model", None)
    assert spec_of(layer["gate_proj"]) == (None, None)  # intermediate 64 does not split 3 ways: replicated
    assert spec_of(layer["attn_norm"]) == (None,)
    assert spec_of(sharded.params["embed"]) == (None, None)  # vocab 101
    q = layer["q_proj"]
    assert {s.data.shape for s in q.addressable_shards} == {(q.shape[0], q.shape[1] // 3)}


def test_mesh_errors_name_the_fix():
    with pytest.raises(MeshError, match=r"tp=2 does not divide the model's 3 KV heads; choose tp in \[1, 3\]"):
        place(MODEL, make_mesh(2, 1))
    with pytest.raises(MeshError, match=r"needs 12 devices but 6 are visible"):
        make_mesh(3, 4)
    with pytest.raises(MeshError, match="tp must be a positive integer"):
        make_mesh(0, 1)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_checkpoints_load_onto_a_mesh(arch, tiny_checkpoint):
    _, ckpt = tiny_checkpoint(arch)
    one = hetero_jax.load(ckpt)
    tp = one.config.num_kv_heads
    sharded = hetero_jax.load(ckpt, mesh=make_mesh(tp, 2))
    assert sharded.mesh is not None and spec_of(sharded.params["layers"][1]["k_proj"]) == (
        None, "model" if tp > 1 else None)
    ids = [np.random.default_rng(1).integers(3, 200, 40).tolist(), np.random.default_rng(2).integers(3, 200, 29).tolist()]
    ref_toks, ref_logits, _ = greedy_with_logits(one, FullKV(), ids, steps=4)
    toks, logits, _ = greedy_with_logits(sharded, FullKV(), ids, steps=4)
    np.testing.assert_array_equal(toks, ref_toks)
    np.testing.assert_allclose(logits, ref_logits, atol=1e-4, rtol=0)


def test_engine_rejects_nothing_on_a_one_device_mesh():
    # tp = dp = 1 on a mesh runs the same executables' maths: identical tokens
    toks, _, _ = single("full")
    got, _, eng = greedy_with_logits(place(MODEL, make_mesh(1, 1)), FullKV(), PROMPTS, steps=8)
    np.testing.assert_array_equal(got, toks)
    assert isinstance(eng, Engine)


@pytest.mark.parametrize("tp", [1, 3])
def test_bytes_computed_from_the_layout_equal_the_measured_shards(tp):
    """benchmarks/bench_mesh.py's per-process table computes each device's bytes from the layout alone (no
    weights, nothing run); here the same computation for the tiny model equals what a run's arrays hold."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_mesh

    prompt = PROMPTS[:1]
    model = place(MODEL, make_mesh(tp, 1)) if tp > 1 else MODEL
    _, _, eng = greedy_with_logits(model, POLICIES["heterocache"], prompt, steps=2)
    _, _, full = greedy_with_logits(model, FullKV(), prompt, steps=2)
    cfg, cache = MODEL.config, eng.cache
    want = bench_mesh.layout_bytes(eng.policy, cfg, tp, len(prompt[0]), cache.tail_capacity,
                                   itemsize=cache.pool.k.dtype.itemsize)

    def one_device(arrays):
        got = per_device_bytes(arrays) if tp > 1 else {"one": sum(a.nbytes for a in arrays)}
        assert len(set(got.values())) == 1, got  # every device holds the same
        return next(iter(got.values()))

    pool = lambda c: [c.pool.k, c.pool.v, c.pool.positions]  # noqa: E731
    assert cache.pool.num_rows == want["heterocache_pool_rows"] and full.cache.pool.num_rows == want["full_pool_rows"]
    assert one_device(pool(cache)) == want["heterocache_pool"] and one_device(pool(full.cache)) == want["full_pool"]
    assert one_device([a for l in cache.layers for a in (l.offsets, l.lengths)]) == want["small"]
    assert one_device([l.state.k_base for l in cache.layers if l.state is not None]) == want["k_base"] > 0
    assert one_device(eng.state.host_arrays()) == want["host"] > 0


def test_a_batch_the_data_axis_does_not_divide_warns():
    """A batch that dp does not divide stays whole on "data": each data device repeats it, and generate says so;
    one it divides is split, without a word."""
    import warnings

    mesh_model = place(MODEL, make_mesh(3, 2))
    with pytest.warns(RuntimeWarning, match=r"a batch of 1 prompt\(s\) does not split over the mesh's dp=2 "
                                            "data-parallel devices, so each of them holds and computes the whole"):
        hetero_jax.generate(mesh_model, PROMPTS[0], max_new_tokens=1, chat=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        res = hetero_jax.generate(mesh_model, PROMPTS, max_new_tokens=1, chat=False)
    assert len(res[0].stats.kv_bytes_per_device) == 6
    # the bytes per device come from the shardings; in one process they equal what the shards hold
    import collections

    arrays = prompt_arrays(Engine(mesh_model, PROMPTS, FullKV(), tail_capacity=8, is_batch=True).cache)
    shards = collections.Counter()
    for a in arrays:
        for s in a.addressable_shards:
            shards[str(s.device)] += s.data.nbytes
    assert per_device_bytes(arrays) == dict(shards) and len(shards) == 6

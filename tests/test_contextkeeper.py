"""ContextKeeper: the offline ranking against a float64 numpy recomputation, what each head keeps against
a numpy plan and a full-KV prefill, rho 1 == full KV, bytes, batch == one-by-one, budget errors, ranking
files for another model, registry and sessions."""

import json
import math
import re

import jax.numpy as jnp
import numpy as np
import pytest

from hetero_jax.model import transformer as M
from hetero_jax.model.cache import LayerPrefill, RowBlock, layer_rows, prompt_kv_bytes
from hetero_jax.runtime import Engine, Session, prefill
from hetero_jax.policies import BudgetError, Composed, ContextKeeper, FullKV, PolicyError, make_policy
from hetero_jax.policies.allocators import RankedFull
from hetero_jax.policies.scorers import WindowVotes
from hetero_jax.policies.contextkeeper.ranking import CARanking, calibrate_ranking, load_ranking
from hetero_jax.profile import ProfileError
from test_policies import np_queries
from tiny_model import tiny_model, random_prompt

MODEL = tiny_model()
CFG, PARAMS = MODEL.config, MODEL.params
S_, R_ = 4, 8  # sinks and recent tokens at the tiny model's scale
N = CFG.num_layers * CFG.num_kv_heads

# hand-set ranking: votes first, then score, then lower (layer, head)
# -> order (1,2) (0,1) (2,0) (0,0) (1,0) (2,2) (1,1) (0,2) (2,1)
VOTES = np.array([[2, 3, 0], [2, 0, 3], [3, 0, 1]])
SCORES = np.array([[0.5, 0.1, 0.2], [0.4, 0.3, 0.9], [0.1, 0.2, 0.8]])
RANKING = CARanking(scores=SCORES, votes=VOTES, model="tiny", head_dim=CFG.head_dim)
ORDER = [(1, 2), (0, 1), (2, 0), (0, 0), (1, 0), (2, 2), (1, 1), (0, 2), (2, 1)]


def ck(rho, **kw):
    return ContextKeeper(ranking=RANKING, budget=rho, sink=S_, recent=R_, **kw)


# ----------------------------------------------------------------- numpy oracles
def np_middle_mass(ids, window, sink, recent):
    """[layers, Hkv] float64: mean over the last `window` rows and the G query heads of the causal
    softmax mass on [sink, L - recent), from each layer's captured input and keys."""
    L = len(ids)
    captured = []

    def observe(li, layer, x_in, k_buf, v_buf, lens):
        captured.append((np.asarray(x_in[0]), np.asarray(k_buf[0], np.float64)))

    tokens = np.zeros((1, 128), np.int32)
    tokens[0, :L] = ids
    M.prefill(PARAMS, CFG, tokens, np.array([L]), chunk=64, tail_capacity=1,
              plan=M.DropKVPlan([L], CFG.num_layers, CFG.num_kv_heads), observe=observe)
    out = np.zeros((CFG.num_layers, CFG.num_kv_heads))
    rows = np.arange(L - window, L)
    for li, (x, keys) in enumerate(captured):
        q = np_queries(PARAMS["layers"][li], x[rows], rows, CFG)  # [H, W, G, D]
        s = np.einsum("hwgd,htd->hwgt", q, keys[:, :L]) / math.sqrt(CFG.head_dim)
        s = np.where(np.arange(L)[None, None, None, :] <= rows[None, :, None, None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[li] = p[..., sink : L - recent].sum(-1).mean(axis=(1, 2))
    return out


def np_n_full(rho, L, sink=S_, recent=R_):
    c = min(L, sink + recent)
    best = -1
    for nf in range(N + 1):  # brute force over every count
        if nf * L + (N - nf) * c <= rho * N * L + 1e-9:
            best = nf
    return best


# ------------------------------------------------------------------------ tests
def test_ranking_equals_a_numpy_recomputation():
    """Scores (Eq. 1 prefill rows, GQA mean), votes (top round(0.65 * 3) = 2 heads per layer and sample)
    and the global order equal a float64 numpy recomputation; samples of two lengths (two prefills)."""
    samples = [random_prompt(60, 1), random_prompt(60, 2), random_prompt(75, 3), random_prompt(75, 4)]
    got = calibrate_ranking(MODEL, samples, window=4, sink=S_, recent=R_, top_p=0.65)
    per = np.stack([np_middle_mass(s, 4, S_, R_) for s in samples])  # [S, layers, H]
    np.testing.assert_allclose(got.scores, per.mean(0), rtol=0, atol=1e-5)
    votes = np.zeros((CFG.num_layers, CFG.num_kv_heads), int)
    for s in range(len(samples)):
        for l in range(CFG.num_layers):
            ranked = sorted(range(CFG.num_kv_heads), key=lambda h: (-per[s, l, h], h))
            for h in ranked[:2]:
                votes[l, h] += 1
    np.testing.assert_array_equal(got.votes, votes)
    assert votes.min() < votes.max()  # the votes discriminate: the order is not the tie-break alone
    want = sorted(((l, h) for l in range(CFG.num_layers) for h in range(CFG.num_kv_heads)),
                  key=lambda lh: (-votes[lh], -per.mean(0)[lh], lh))
    assert [tuple(x) for x in got.order()] == want
    assert got.settings["sink"] == S_ and got.settings["samples"] == 4


def test_each_head_keeps_what_numpy_says_with_the_full_kv_rows():
    """rho 0.5, L 120: N_full by brute force; the top N_full heads of the ranking hold all 120 positions,
    the others exactly [0, s) + [L - r, L); every kept K/V row equals a full-KV prefill's row."""
    L, rho = 120, 0.5
    ids = random_prompt(L, 5)
    nf = np_n_full(rho, L)
    assert nf == 4 and ck(rho).allocator.n_full("ContextKeeper", rho, CFG, L) == nf
    full_heads = set(ORDER[:nf])
    want = np.full((CFG.num_layers, CFG.num_kv_heads), S_ + R_)  # layout order: a layer's full heads first
    for li in range(CFG.num_layers):
        want[li, : sum(l == li for l, _ in ORDER[:nf])] = L
    np.testing.assert_array_equal(ck(rho).head_budgets(CFG, L), want)  # the allocator's grid
    eng = Engine(MODEL, [ids], ck(rho), tail_capacity=4)
    _, ref = prefill(PARAMS, CFG, [ids], tail_capacity=4)
    perms = ck(rho).layout(CFG).perms
    for li in range(CFG.num_layers):
        assert list(perms[li]) == [h for l, h in ORDER if l == li]  # layout = ranking order in each layer
        rk, rv = (np.asarray(a[0]) for a in layer_rows(ref, li)[:2])
        gk, gv, gpos, glen = (np.asarray(a[0]) for a in layer_rows(eng.cache, li))
        assert gk.shape[0] == CFG.num_kv_heads
        for slot in range(CFG.num_kv_heads):  # each head's region of the pool, in layout order
            h = perms[li][slot]
            n = int(glen[slot])
            pos = gpos[slot, :n]
            want = np.arange(L) if (li, h) in full_heads else np.r_[0:S_, L - R_:L]
            np.testing.assert_array_equal(pos, want, err_msg=f"layer {li} head {h}")
            np.testing.assert_allclose(gk[slot, :n], rk[h, pos], atol=1e-5)
            np.testing.assert_allclose(gv[slot, :n], rv[h, pos], atol=1e-5)
    kept = nf * L + (N - nf) * (S_ + R_)
    assert eng.achieved_rho[0] == pytest.approx(kept / (N * L))
    assert eng.state.stats()["n_full"] == [nf]
    assert eng.state.stats()["full_heads"] == [[list(x) for x in ORDER[:nf]]]


def test_every_layer_keeps_a_full_head_before_any_layer_keeps_a_second():
    """A ranking whose best three heads are all in layer 0: at the budget of three full heads the global prefix
    would leave layers 1 and 2 with sinks and recent tokens only; the allocator keeps each layer's best head
    whole instead (its layer floor), in a numpy-built order, and the cache holds exactly those heads whole."""
    scores = np.array([[0.9, 0.8, 0.7], [0.6, 0.5, 0.2], [0.4, 0.1, 0.05]])
    ranking = CARanking(scores=scores, votes=np.zeros((3, 3), np.int64), model="tiny", head_dim=CFG.head_dim)
    assert [tuple(x) for x in ranking.order()[:3]] == [(0, 0), (0, 1), (0, 2)]
    seen, first, rest = set(), [], []
    for l, h in ranking.order():  # numpy oracle: each layer's first appearance, then the rest
        (rest if l in seen else first).append((int(l), int(h)))
        seen.add(l)
    pol = ContextKeeper(ranking=ranking, budget=0.5, sink=S_, recent=R_)
    assert [tuple(x) for x in pol.allocator.order()] == first + rest == [(0, 0), (1, 0), (2, 0), (0, 1), (0, 2),
                                                                        (1, 1), (1, 2), (2, 1), (2, 2)]
    L = 120
    nf = pol.allocator.n_full("ContextKeeper", 0.5, CFG, L)
    assert nf == np_n_full(0.5, L) == 4
    np.testing.assert_array_equal(pol.allocator.full_per_layer(3, CFG), [1, 1, 1])
    np.testing.assert_array_equal(pol.allocator.full_per_layer(nf, CFG), [2, 1, 1])
    eng = Engine(MODEL, [random_prompt(L, 9)], pol, tail_capacity=4)
    perms = pol.layout(CFG).perms
    whole = {(li, int(perms[li][slot])) for li in range(CFG.num_layers)
             for slot, n in enumerate(np.asarray(layer_rows(eng.cache, li)[3][0])) if n == L}
    assert whole == set((first + rest)[:nf])
    assert eng.state.stats()["full_heads"] == [[list(x) for x in (first + rest)[:nf]]]


def logits_run(policy, batch, steps=4):
    eng = Engine(MODEL, batch, policy, tail_capacity=steps + 2, is_batch=len(batch) > 1)
    out = [np.asarray(eng.logits)]
    tok = eng.first_tokens(0.0, 1.0)
    toks = [tok]
    for _ in range(steps):
        tok, lg = eng.step_with_logits(tok)
        out.append(np.asarray(lg))
        toks.append(tok)
    return np.stack(out, 1), np.stack(toks, 1), eng


def test_rho_one_equals_full_kv():
    ids = random_prompt(90, 6)
    want, wt, _ = logits_run(FullKV(), [ids])
    got, gt, eng = logits_run(ck(1.0), [ids])
    np.testing.assert_allclose(got, want, atol=1e-4)
    np.testing.assert_array_equal(gt, wt)
    assert eng.state.stats()["n_full"] == [N] and eng.achieved_rho[0] == 1.0


def test_device_bytes_within_rho():
    L, rho = 300, 0.3
    eng = Engine(MODEL, [random_prompt(L, 7)], ck(rho), tail_capacity=4)
    full_bytes = L * N * 2 * CFG.head_dim * 4
    got = prompt_kv_bytes(eng.cache)
    assert got <= rho * full_bytes * 1.05
    nf = np_n_full(rho, L)
    assert got == (nf * L + (N - nf) * (S_ + R_)) * 2 * CFG.head_dim * 4
    assert eng.state.stats()["bytes_rho"] == pytest.approx(got / full_bytes)
    assert eng.state.stats()["bytes_rho"] == pytest.approx(eng.achieved_rho[0])


def test_batch_of_two_lengths_equals_one_by_one():
    """L 60 -> 3 full heads, L 200 -> 4 at rho 0.5: one head per batch is full for one sequence only."""
    a, b = random_prompt(60, 8), random_prompt(200, 9)
    assert np_n_full(0.5, 60) == 3 and np_n_full(0.5, 200) == 4
    got, gt, eng = logits_run(ck(0.5), [a, b])
    assert eng.state.stats()["n_full"] == [3, 4]
    for i, ids in enumerate((a, b)):
        want, wt, one = logits_run(ck(0.5), [ids])
        np.testing.assert_allclose(got[i], want[0], atol=1e-4)
        np.testing.assert_array_equal(gt[i], wt[0])
        assert eng.achieved_rho[i] == pytest.approx(one.achieved_rho[0])


def test_budget_error_names_the_smallest_rho():
    L = 100
    ids = random_prompt(L, 10)
    with pytest.raises(BudgetError, match=r"smallest rho that works .* is rho=([0-9.]+)") as e:
        Engine(MODEL, [ids], ck(0.05), tail_capacity=2)
    rho = float(re.search(r"is rho=([0-9.]+)", str(e.value)).group(1))
    assert rho == 0.12  # (s + r) / L
    eng = Engine(MODEL, [ids], ck(rho), tail_capacity=2)
    assert eng.state.stats()["n_full"] == [0]
    with pytest.raises(BudgetError):
        Engine(MODEL, [ids], ck(round(rho - 1e-4, 4)), tail_capacity=2)
    # a prompt no longer than s + r: every head keeps it all, so only rho 1 is honest
    with pytest.raises(BudgetError, match=r"rho=1\b"):
        Engine(MODEL, [random_prompt(10, 11)], ck(0.9), tail_capacity=2)
    # the paper's defaults (128 + 256) on a short prompt name rho = 384 / L
    with pytest.raises(BudgetError, match=r"rho=0\.96\b"):
        Engine(MODEL, [random_prompt(400, 12)], ContextKeeper(ranking=RANKING, budget=0.5), tail_capacity=2)
    # the allocator composed with a scorer needing more than sink + recent refuses before any compute
    with pytest.raises(PolicyError, match=r"sink \+ recent = 4\+8 token\(s\), but the scorer needs 32"):
        Composed(0.5, WindowVotes(window=32), RankedFull(RANKING, S_, R_)).make_prefill(CFG, [L])
    with pytest.raises(PolicyError, match=r"RankedFull: ranking must be a CARanking.*got dict"):
        RankedFull({}, S_, R_)


def test_ranking_for_another_model_is_refused(tmp_path):
    other = CARanking(scores=np.zeros((30, 3)), votes=np.zeros((30, 3), int), model="smollm2-135m")
    with pytest.raises(ProfileError, match=r"\b30 layers x 3 KV heads.*model has 3 layers.*another model.*Calibrate"):
        Engine(MODEL, [random_prompt(50)], ContextKeeper(ranking=other, budget=0.5, sink=S_, recent=R_), tail_capacity=2)
    # no ranking shipped for the tiny model: the default refuses and says how to get one
    with pytest.raises(ProfileError, match=r"ships none for tiny.*calibrate"):
        Engine(MODEL, [random_prompt(50)], ContextKeeper(budget=0.5, sink=S_, recent=R_), tail_capacity=2)
    path = tmp_path / "r.json"
    RANKING.save(path)
    back = load_ranking(path)
    np.testing.assert_array_equal(back.votes, VOTES)
    assert back.key() == RANKING.key()
    assert json.loads(path.read_text())["order"] == [list(x) for x in ORDER]
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ProfileError, match="not a hetero-jax-contextkeeper-ranking"):
        load_ranking(tmp_path / "bad.json")


def test_registry_cli_spec_and_session(tmp_path):
    p = make_policy("contextkeeper", 0.5)
    assert isinstance(p, ContextKeeper) and p.budget == 0.5 and (p.sink, p.recent) == (128, 256)
    path = tmp_path / "r.json"
    RANKING.save(path)
    q = make_policy(f"contextkeeper:ranking={path},sink={S_},recent={R_}", 0.5)
    assert q.ranking_key == RANKING.key() and q == ck(0.5)
    # a 3-turn session: the compressed heads' prompt part never changes while the tail grows
    sess = Session(MODEL, random_prompt(120, 13), q, chat=False, reserve_tokens=16)
    rows = lambda: [[np.asarray(a) for a in layer_rows(sess.engine.cache, li)]  # noqa: E731 - prompt rows only
                    for li in range(CFG.num_layers)]
    before = rows()
    for t in range(3):
        sess.ask(random_prompt(5, 14 + t), max_new_tokens=2, stop=None)
        after = rows()
        for x, y in zip(before, after):  # keys, values, positions and lengths of every head's prompt rows
            for u, v in zip(x, y):
                np.testing.assert_array_equal(u, v)
    assert int(np.asarray(sess.engine.cache.tail_lens)[0]) > 15


def test_shipped_smollm2_ranking_is_resolved_by_shape_and_name():
    """The shipped file loads, fits SmolLM2-135M's 30 x 3 KV heads, and bind() finds it for that model
    (a config stand-in: no weights are loaded); another shape gets none."""
    from types import SimpleNamespace

    from hetero_jax.policies.contextkeeper.ranking import default_ranking, shipped_ranking_path

    r = load_ranking(shipped_ranking_path("smollm2-135m"))
    assert r.shape == (30, 3) and r.model == "smollm2-135m" and r.head_dim == 64
    assert r.settings["sink"] == 128 and r.settings["recent"] == 256 and r.settings["samples"] >= 4
    assert r.votes.max() <= r.settings["samples"] and len({tuple(x) for x in r.order()}) == 90
    smol = SimpleNamespace(name="smollm2-135m", config=SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64))
    bound = ContextKeeper(budget=0.5).bind(smol)
    assert bound.ranking_key == r.key()
    assert default_ranking(MODEL) is None


def test_profile_cli_writes_a_ranking(tiny_checkpoint, tmp_path, capsys):
    """`hetero-jax profile --method contextkeeper` on a converted checkpoint writes a ranking of its shape;
    a bad --top-p is refused before any work."""
    from hetero_jax.cli import main

    _, ours = tiny_checkpoint("llama")
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"word{i % 97} and{i % 13}" for i in range(3000)))
    out = tmp_path / "rank.json"
    args = ["profile", "--method", "contextkeeper", "--model", ours, "--data", str(text), "--tokens", "64",
            "--samples", "2", "--sink", "4", "--recent", "8", "--ck-window", "4", "--no-progress", "--out", str(out)]
    assert main(args) == 0
    r = load_ranking(out)
    import hetero_jax

    cfg = hetero_jax.load(ours).config
    assert r.shape == (cfg.num_layers, cfg.num_kv_heads) and r.settings["samples"] == 2
    assert r.settings["sink"] == 4 and r.settings["recent"] == 8 and r.settings["window"] == 4
    captured = capsys.readouterr()
    assert "heads per vote count" in captured.out and "rank heads" not in captured.err  # --no-progress
    # without --no-progress a bar follows the prefill's layers (the calibration printed nothing for a minute)
    assert main([a for a in args if a != "--no-progress"]) == 0
    assert "rank heads: 100%" in capsys.readouterr().err
    assert main(args[:-2] + ["--top-p", "1.5", "--out", str(tmp_path / "x.json")]) == 2
    assert "--top-p must be in (0, 1]" in capsys.readouterr().err


def test_decode_logits_equal_a_full_kv_cache_reduced_to_the_kept_rows():
    """rho 0.4, L 150: each decode step's logits equal a plain decode over a full-KV cache (original head
    order, unpermuted weights) where every head holds exactly its numpy-planned rows."""
    import jax

    L, rho = 150, 0.4
    ids = random_prompt(L, 20)
    nf = np_n_full(rho, L)
    assert 0 < nf < N
    full_heads = set(ORDER[:nf])
    eng = Engine(MODEL, [ids], ck(rho), tail_capacity=6)
    H = CFG.num_kv_heads
    planned = [[np.arange(L) if (li, h) in full_heads else np.r_[0:S_, L - R_:L] for h in range(H)]
               for li in range(CFG.num_layers)]

    class Planned:
        """Full KV's prefill reduced to the numpy-planned rows: each head (original order) keeps exactly those."""

        def prompt_counts(self):
            return np.array([[[len(p) for p in layer]] for layer in planned])  # [L, 1, H]

        def build_layer(self, li, layer, x_in, k_buf, v_buf, lens):
            n = max(len(p) for p in planned[li])
            idx = np.stack([np.pad(p, (0, n - len(p)), mode="edge") for p in planned[li]])  # [H, n]
            pos = np.stack([np.pad(p, (0, n - len(p)), constant_values=-1) for p in planned[li]])
            take = lambda a: jnp.asarray(np.asarray(a)[:, np.arange(H)[:, None], idx])  # noqa: E731
            return LayerPrefill(blocks=(RowBlock(k=take(k_buf), v=take(v_buf), positions=jnp.asarray(pos[None], jnp.int32),
                                                 lengths=jnp.asarray([[len(p) for p in planned[li]]], jnp.int32),
                                                 heads=tuple(range(H))),))

    _, cache = prefill(PARAMS, CFG, [ids], tail_capacity=6, plan=Planned())
    tok = eng.first_tokens(0.0, 1.0)
    for _ in range(4):
        want, cache = M.decode_step_jit(PARAMS, cache, jax.numpy.asarray(tok), CFG)
        tok, got = eng.step_with_logits(tok)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)
        assert int(tok[0]) == int(np.asarray(want)[0].argmax())


def test_ranking_variants_script_writes_orders_and_never_overwrites(tmp_path):
    """benchmarks/contextkeeper_rankings.py (the trace of RESULTS contextkeeper-layer-floor): each file loads as
    a ranking whose order is the shipped one reversed, a permutation of it, or the profile's copy score falling;
    a second run into the same folder is refused before writing."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import contextkeeper_rankings as cr

    assert cr.main(["--out-dir", str(tmp_path)]) == 0
    shipped = load_ranking(cr.DATA / "smollm2-135m.contextkeeper.json").order()
    rev, rnd, cp = (load_ranking(tmp_path / f"ck-{n}.json").order() for n in ("reversed", "random", "copy"))
    np.testing.assert_array_equal(rev, shipped[::-1])
    assert sorted(map(tuple, rnd)) == sorted(map(tuple, shipped)) and not np.array_equal(rnd, shipped)
    copy = np.asarray(json.loads((cr.DATA / "smollm2-135m.profile.json").read_text())["copy_score"], float)
    assert np.all(np.diff(copy[cp[:, 0], cp[:, 1]]) <= 0)
    before = (tmp_path / "ck-copy.json").read_bytes()
    with pytest.raises(SystemExit, match="nothing is overwritten"):
        cr.main(["--out-dir", str(tmp_path)])
    assert (tmp_path / "ck-copy.json").read_bytes() == before


def test_ranked_full_composed_with_a_scorer_keeps_the_ranked_heads_whole():
    """RankedFull's budgets are per layout slot (each layer's heads in ranking order); Composed had no layout, so
    heads 0.. of each layer kept the whole prompt whatever the ranking said. Now the composition keeps the heads
    the ranking names (RankedFull.order(), by hand from the ranking) and answers as ContextKeeper does."""
    from hetero_jax.policies.scorers import SinksRecent

    L, rho = 120, 0.5
    ids = random_prompt(L, 5)
    comp = Composed(budget=rho, scorer=SinksRecent(S_), allocator=RankedFull(RANKING, S_, R_))

    def whole_heads(policy):
        eng = Engine(MODEL, [ids], policy, tail_capacity=4)
        perms = policy.layout(CFG).perms
        return eng, {(li, int(perms[li][s])) for li, lc in enumerate(eng.cache.layers)
                     for s, n in enumerate(np.asarray(lc.lengths)[0]) if n == L}

    eng, got = whole_heads(comp)
    n_full = RankedFull(RANKING, S_, R_).n_full("t", rho, CFG, L)
    assert 0 < n_full < CFG.num_layers * CFG.num_kv_heads
    assert got == {tuple(h) for h in RankedFull(RANKING, S_, R_).order()[:n_full].tolist()}
    ref, want = whole_heads(ck(rho))
    assert got == want
    tok = eng.first_tokens(0.0, 1.0)
    assert tok.tolist() == ref.first_tokens(0.0, 1.0).tolist()
    np.testing.assert_allclose(eng.step_with_logits(tok)[1], ref.step_with_logits(tok)[1], atol=1e-5)

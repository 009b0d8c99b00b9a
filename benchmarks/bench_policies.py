#!/usr/bin/env python
"""Policy sweep: device KV, achieved rho, decode ms/token vs full KV, and passkey accuracy.

SmolLM2-135M (``hetero_jax.load("smollm2-135m")``), batch 1, greedy. For each
prompt length (default 4000 and 7900 tokens: "4K" and "8K" with room for the
new tokens inside the 8192-token context) and each needle depth (default 0.1,
0.5, 0.9), one passkey prompt is built with ``benchmarks/haystack.py`` (real
text from ``pydoc_data.topics``, "The pass key is K. Remember it. K is the
pass key." at that depth, then "What is the pass key?" in the chat template,
exactly N tokens). Every registered policy runs on it at every budget rho
(default 0.3 and 0.5; full KV once as the reference).

How one prompt is run (all policies in one process, side by side):

1. **One shared prefill per head layout.** Prefill's forward pass does not
   depend on the policy (each layer's full prompt KV is built first; a policy
   only chooses what of it to keep), so the layer-major prefill runs once and
   every policy's ``build_layer`` hook runs on each layer's KV in turn
   (HeteroCache permutes the KV heads, so it gets its own prefill). Each policy
   gets the cache ``generate(model, ids, policy)`` would build (``finish``
   applied) and ``generate``'s decode ``Engine`` around it. The baselines'
   token scores never read the budget, so within a layer they are computed once
   per policy and shared by its budgets (``--no-share-scores`` turns this off).
   ``--check-generate`` re-runs ``generate`` for every policy on the first
   prompt and checks the tokens, KV bytes and achieved rho agree.
2. **Interleaved decode.** Greedy decode steps run round-robin over all the
   policies' engines (the order rotates every step) with ``Engine.step``, the
   step ``generate`` runs (HeteroCache's drift checks and recalls included).
   On the ``--timing-depth`` prompt of each length, the first
   ``--warmup-steps`` steps per engine are untimed and the next
   ``--decode-steps`` are timed (wall time including reading the token back;
   compile time excluded, as in ``generate``); decode continues past EOS for
   timing only. The other prompts decode just their answers.
3. **Accuracy.** The first ``--max-new-tokens`` generated tokens (up to EOS)
   are the answer; correct iff they contain the passkey as a number.

KV bytes and achieved rho are ``Engine.stats_fields()`` (what
``GenerationStats`` reports) when the answer is complete. A policy's decode
ms/token is the median over its timed steps; its ratio to full KV divides by
full KV's median from the same interleaved steps (means in the JSON too).

Cost on a 2-core CPU: compile dominates small runs (every policy's cache shape
compiles its own decode step; CAKE's data-dependent per-layer budgets recompile
selection and decode for every prompt). The persistent XLA cache
(``hetero_jax.cli.enable_compilation_cache``) makes reruns start faster.

Outputs: ``--out`` JSON (full config, machine, commit, every sample), a PNG
beside it, a markdown table on stdout, and with ``--write-results`` the
``policies`` section of ``benchmarks/RESULTS.md``.

    .venv/bin/python benchmarks/bench_policies.py --write-results
    .venv/bin/python benchmarks/bench_policies.py --lengths 1024 --depths 0.5 --budgets 0.5 \\
        --policies full snapkv --decode-steps 8                          # smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (benchmarks/common.py)
import haystack  # noqa: E402  (benchmarks/haystack.py)

SECTION = "policies"
MODEL = "smollm2-135m"
DEFAULT_LENGTHS = (4000, 7900)
DEFAULT_BUDGETS = (0.3, 0.5)
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
MiB = 2**20


# ------------------------------------------------------------------ combos
def policy_names() -> list[str]:
    from hetero_jax.policies import REGISTRY

    return list(REGISTRY)


# ----------------------------------------------------------- shared prefill
class SharedPrefill:
    """One layer-major prefill feeding several policies' prefill plans.

    ``hetero_jax.model.transformer.prefill`` (run with ``DropKVPlan``: its own cache keeps no prompt row) calls
    the ``observe(li, layer, x_in, k_buf, v_buf, lens)`` hook once per layer with that layer's full prompt
    KV; here every plan's ``build_layer`` sees the same arguments and its output goes straight into that
    plan's own ``cache.PoolBuilder`` (one pool per plan, allocated from its ``prompt_counts()`` by
    :meth:`start`). The policies must share one head layout (the same permuted params). :meth:`caches`
    finishes one cache per policy and applies each plan's ``finish``.
    """

    def __init__(self, plans, compile_fn, on_layer=None):
        import jax

        from hetero_jax.model import transformer as M

        self._jax, self._M = jax, M
        self.plans, self.compile_fn = list(plans), compile_fn
        self.on_layer = on_layer
        self._scores: dict = {}
        self.builders: list = []
        self.hook_seconds = [0.0] * len(self.plans)  # scoring + selection + pool writes per policy (compile included)

    def start(self, cfg, prompt_lens, tail_capacity: int, dtype, mesh=None) -> None:
        """One ``PoolBuilder`` per plan (each pool allocated from its plan's counts), before the prefill."""
        from hetero_jax.model.cache import PoolBuilder

        self.hook_seconds = [0.0] * len(self.plans)
        self.builders = []
        for i, plan in enumerate(self.plans):
            t0 = time.perf_counter()
            self.builders.append(PoolBuilder(plan, prompt_lens, cfg, tail_capacity, dtype, mesh=mesh,
                                             compile_fn=self.compile_fn))
            self.hook_seconds[i] += time.perf_counter() - t0

    def drop_plan(self, cfg, prompt_lens):
        """The plan of the shared prefill's own cache: it keeps no prompt row (every policy has its pool)."""
        return self._M.DropKVPlan(prompt_lens, cfg.num_layers, cfg.num_kv_heads)

    def compile_fn_sharing_scores(self):
        """``compile_fn`` for the plans: one policy's per-layer token scores serve all its budgets.

        The baselines' ``token_scores`` never read the budget (only the selection
        after it does), so within a layer the scores of e.g. H2O(0.3) and
        H2O(0.5) are one computation; it runs once and is reused.
        """
        from hetero_jax.policies import CAKE, H2O, PyramidKV, SnapKV, StreamingLLM
        from hetero_jax.policies.selection import layer_scores

        shareable = (StreamingLLM, SnapKV, PyramidKV, H2O, CAKE)

        def compile_fn(f, *args, **static):
            exe = self.compile_fn(f, *args, **static)
            pol = static.get("policy")
            if f is not layer_scores or type(pol) not in shareable:
                return exe
            key = (type(pol), dataclasses.replace(pol, budget=1.0))

            def run(*a):
                if key not in self._scores:
                    self._scores[key] = exe(*a)
                return self._scores[key]

            return run

        return compile_fn

    def add(self, i: int, li: int, layer, x_in, k_buf, v_buf, lens) -> None:
        """Plan ``i``'s layer ``li`` into its pool, timed (the pool write included)."""
        jax = self._jax
        t0 = time.perf_counter()
        done = self.builders[i].add(li, self.plans[i].build_layer(li, layer, x_in, k_buf, v_buf, lens))
        jax.block_until_ready(done)
        self.hook_seconds[i] += time.perf_counter() - t0

    def observe(self, li, layer, x_in, k_buf, v_buf, lens):
        self._jax.block_until_ready((x_in, k_buf, v_buf))  # the layer's forward pass is not the hooks' time
        self._scores.clear()
        for i in range(len(self.plans)):
            self.add(i, li, layer, x_in, k_buf, v_buf, lens)
        if self.on_layer is not None:
            self.on_layer(li)

    def caches(self, prompt_lens):
        """One (cache, decode state) per policy: its builder's cache (own buffers: the decode step donates
        every cache leaf), then its plan's ``finish``. prompt_lens: [B] int32 (device)."""
        jax = self._jax
        out = []
        for i, (plan, builder) in enumerate(zip(self.plans, self.builders)):
            t0 = time.perf_counter()
            cache, state = plan.finish(builder.cache(jax.numpy.array(prompt_lens)))
            jax.block_until_ready((cache, state.host_arrays()))
            self.hook_seconds[i] += time.perf_counter() - t0
            out.append((cache, state))
        self.builders = []
        return out


def layout_key(layout):
    """A head layout as a grouping key: None for the identity (policies that keep heads in model order)."""
    return None if layout is None or getattr(layout, "is_identity", False) else layout


def make_engines(model, ids: list[int], policies, tail_capacity: int, bar=None, share_scores: bool = True):
    """Prefill ``ids`` once per head layout for all ``policies``; one decode ``Engine`` per policy.

    Each engine is what ``generate`` builds (``Engine.__init__``: bound policy,
    plan, layout params, cache and decode state from ``finish``), except
    that the prefill forward pass is shared. Returns (engines, info per policy).
    """
    import jax
    import numpy as np

    from hetero_jax.model import layout as LY

    from hetero_jax import runtime as G
    cfg = model.config
    bound = [G.bind_policy(model, p) for p in policies]
    groups: dict = {}
    for i, p in enumerate(bound):
        groups.setdefault(layout_key(p.layout(cfg)), []).append(i)
    engines, info = [None] * len(bound), [None] * len(bound)
    for key, idx in groups.items():
        c0 = G.compile_seconds()
        t0 = time.perf_counter()
        params = LY.params_for(model, key)
        def on_layer(li, what=f"prefill ({'identity' if key is None else 'permuted'} layout, {len(idx)} policies)"):
            if bar is not None:
                bar.set_postfix_str(f"{what}: layer {li + 1}/{cfg.num_layers}")

        shared = SharedPrefill([None] * len(idx), G.compiled, on_layer)
        fn = shared.compile_fn_sharing_scores() if share_scores else G.compiled
        plans = [bound[i].make_prefill(cfg, [len(ids)], compile_fn=fn) for i in idx]  # checks budgets
        shared.plans = plans
        lens = [len(ids)]
        shared.start(cfg, lens, tail_capacity, params["embed"].dtype)
        logits, _ = G.prefill(params, cfg, [ids], tail_capacity=1, plan=shared.drop_plan(cfg, lens),
                              observe=shared.observe)
        caches = shared.caches(np.asarray(lens, np.int32))
        jax.block_until_ready(logits)
        wall = time.perf_counter() - t0
        compile_s = G.compile_seconds() - c0
        hooks = sum(shared.hook_seconds)
        forward = wall - hooks
        for j, i in enumerate(idx):
            cache, state = caches[j]
            engines[i] = G.Engine.from_prefilled(  # compile included in the hook part of prefill_seconds
                model, bound[i], [len(ids)], params, logits, cache, state,
                prefill_seconds=forward + shared.hook_seconds[j])
            info[i] = {"layout": "identity" if key is None else "permuted", "shared_with": len(idx),
                       "prefill_forward_seconds": forward, "policy_prefill_seconds": shared.hook_seconds[j],
                       "prefill_group_wall_seconds": wall, "prefill_group_compile_seconds": compile_s}
    return engines, info




# ------------------------------------------------------------- one prompt
def run_prompt(model, ids: list[int], combos, policies, *, max_new: int, warmup: int, steps: int, timed: bool,
               share_scores: bool = True, bar=None):
    """Prefill once per layout for every policy, then decode all engines round-robin. One dict per combo.

    ``timed``: decode ``warmup + steps`` steps per engine and time the last ``steps``; otherwise stop each
    engine when its answer is complete (EOS or ``max_new`` tokens).
    """
    from hetero_jax import runtime as G
    cfg = model.config
    eos = set(model.tokenizer.eos_token_ids) | set(cfg.eos_token_ids)
    # tokens generated per cache (the first comes from prefill); the tail is sized as for a timed prompt
    # either way, so every prompt of a length shares the compiled decode steps
    total_timed = max(max_new, warmup + steps + 1)
    total = total_timed if timed else max_new
    tail_capacity = G.tail_capacity_for(total_timed)

    c0 = G.compile_seconds()
    t0 = time.perf_counter()
    engines, info = make_engines(model, ids, policies, tail_capacity, bar, share_scores)
    prefill_wall = time.perf_counter() - t0
    prefill_compile = G.compile_seconds() - c0
    after_prefill = [common.engine_kv_stats(e) for e in engines]

    n = len(combos)
    out_ids: list[list[int]] = [[] for _ in range(n)]
    done = [False] * n
    stop = ["max_new_tokens"] * n
    answer_stats: list[dict | None] = [None] * n

    def accept(i, t):
        if done[i]:
            return
        if t in eos:
            done[i], stop[i] = True, "eos"
        else:
            out_ids[i].append(t)
            done[i] = len(out_ids[i]) >= max_new
        if done[i]:  # the answer is complete: KV as generate(max_new_tokens) would report it
            answer_stats[i] = common.engine_kv_stats(engines[i])

    toks = [int(e.first_tokens(0.0, 1.0)[0]) for e in engines]
    for i in range(n):
        accept(i, toks[i])
    times: list[list[float]] = [[] for _ in range(n)]
    c1 = G.compile_seconds()
    for step in range(total - 1):
        if not timed and all(done):
            break
        order = [(step + j) % n for j in range(n)]  # rotate: no policy always runs right after another
        for i in order:
            if not timed and done[i]:
                continue
            nxt, seconds = engines[i].step([toks[i]], 0.0, 1.0)  # compile time is excluded by Engine.step
            if timed and step >= warmup and len(times[i]) < steps:
                times[i].append(seconds)
            toks[i] = int(nxt[0])
            accept(i, toks[i])
        if bar is not None:
            bar.set_postfix_str(f"decode step {step + 1}/{total - 1} x {n} policies")
    decode_compile = G.compile_seconds() - c1
    final = [common.engine_kv_stats(e) for e in engines]
    engines.clear()  # free the caches now (the list, not the name: accept() above closes over it)
    if bar is not None:
        bar.update(1)

    results = []
    for i, (name, rho) in enumerate(combos):
        st = answer_stats[i] or final[i]
        results.append({
            "policy": name, "rho": rho, "label": common.combo_label(name, rho), "policy_repr": repr(policies[i]),
            **st,
            "kv_after_prefill": after_prefill[i],
            "recall_after_timing": final[i]["recall"],
            "generated_ids": out_ids[i],
            "text": model.tokenizer.decode(out_ids[i]),
            "stop_reason": stop[i],
            "decode_seconds": times[i],
            **info[i],
        })
    meta = {"prefill_wall_seconds": prefill_wall, "prefill_compile_seconds": prefill_compile,
            "decode_compile_seconds": decode_compile, "tail_capacity": tail_capacity, "timed": timed}
    return results, meta


def check_against_generate(model, ids, combos, policies, results, max_new, tail_capacity) -> list[str]:
    """Re-run ``generate`` per policy; return the mismatches (empty when everything agrees)."""
    import hetero_jax
    from hetero_jax import runtime as G

    same_tail = G.tail_capacity_for(max_new) == tail_capacity  # else the tails differ by design
    problems = []
    for (name, rho), pol, r in zip(combos, policies, results):
        g = hetero_jax.generate(model, ids, pol, max_new_tokens=max_new, temperature=0.0)
        s = g.stats
        want = {"generated_ids": g.token_ids, "kv_bytes_prompt": s.kv_bytes_prompt, "achieved_rho": s.achieved_rho,
                "kv_bytes_host": s.kv_bytes_host}
        if same_tail:
            want["kv_bytes_tail"] = s.kv_bytes_tail
        for k, v in want.items():
            got = r[k]
            if (abs(got - v) > 1e-9) if isinstance(v, float) else (got != v):
                problems.append(f"{common.combo_label(name, rho)}: {k} shared-prefill {got!r} vs generate {v!r}")
    return problems


# ------------------------------------------------------------------- main run
def run(args) -> dict:
    import jax
    from tqdm import tqdm

    import hetero_jax
    from hetero_jax.policies import make_policy

    if not args.no_compile_cache:
        from hetero_jax.cli import enable_compilation_cache

        enable_compilation_cache()
    combos = common.make_combos(args.policies, args.budgets)
    policies = [make_policy(n, None if n == "full" else r) for n, r in combos]

    t0 = time.perf_counter()
    model = hetero_jax.load(args.model, dtype=args.dtype, progress=False)
    load_s = time.perf_counter() - t0
    cfg = model.config
    ctx = cfg.max_position_embeddings
    total_new = max(args.max_new_tokens, args.warmup_steps + args.decode_steps + 1)
    for L in args.lengths:
        if L + total_new > ctx:
            raise SystemExit(f"prompt {L} + {total_new} new tokens exceeds the model's context of {ctx} tokens; "
                             f"use --lengths of at most {ctx - total_new}")

    machine = common.machine_info()
    config = {
        "model": args.model, "dtype": str(jax.tree.leaves(model.params)[0].dtype),
        "lengths": args.lengths, "depths": args.depths, "budgets": args.budgets,
        "policies": [n for n, _ in combos[:1]] + list(dict.fromkeys(n for n, _ in combos[1:])),
        "combos": [common.combo_label(n, r) for n, r in combos],
        "policy_reprs": [repr(p) for p in policies],
        "max_new_tokens": args.max_new_tokens, "warmup_steps": args.warmup_steps,
        "decode_steps": args.decode_steps, "timing_depth": args.timing_depth or "all",
        "share_scores": not args.no_share_scores, "compile_cache": not args.no_compile_cache,
        "seed": args.seed, "instruction": args.instruction,
        "temperature": 0.0, "batch": 1,
        "needle": haystack.PASSKEY_NEEDLE, "question": haystack.PASSKEY_QUESTION,
        "haystack": "pydoc_data.topics.topics, sorted keys joined by blank lines (benchmarks/haystack.py)",
        "chat_template": True, "check_generate": args.check_generate,
        "out": str(args.out), "plot": str(args.plot),
        "prefill": "one shared layer-major prefill per prompt; every policy's build_layer hook on each layer",
        "decode_timing": "round-robin over all policies' caches, order rotated per step; "
                         "warm-up steps untimed; wall time per step incl. token read-back",
    }
    payload = common.report_header(SECTION, config, machine)
    payload["load_seconds"] = load_s
    payload["prompts"] = []
    payload["runs"] = runs = []
    payload["checks"] = []

    n_prompts = len(args.lengths) * len(args.depths)
    bar = tqdm(total=n_prompts, desc="policies", unit="prompt", dynamic_ncols=True)
    for L in args.lengths:
        for d in args.depths:
            bar.set_description(f"{L} tok, depth {d:g}")
            p = haystack.build_passkey(model.tokenizer, L, d, seed=args.seed, instruction=args.instruction)
            if not p.exact:
                tqdm.write(f"note: the {L}-token prompt at depth {d:g} has {p.n_tokens} tokens")
            t_p = time.perf_counter()
            res, meta = run_prompt(model, p.ids, combos, policies, max_new=args.max_new_tokens,
                                   warmup=args.warmup_steps, steps=args.decode_steps,
                                   timed=args.timing_depth is None or d == args.timing_depth,
                                   share_scores=not args.no_share_scores, bar=bar)
            prompt_rec = {
                "length": L, "depth": d, "prompt_tokens": p.n_tokens, "passkey": p.answer,
                "needle_token_start": p.needle_token_starts[0], "actual_depth": p.actual_depths[0],
                "seconds": time.perf_counter() - t_p, **meta,
            }
            payload["prompts"].append(prompt_rec)
            for r in res:
                r.update(length=L, depth=d, prompt_tokens=p.n_tokens, passkey=p.answer,
                         correct=haystack.passkey_correct(r["text"], p.answer))
                runs.append(r)
            full = res[0]
            tqdm.write(
                f"[{L} tok d={d:g} key {p.answer}] prefill {meta['prefill_wall_seconds']:.0f} s "
                f"(compile {meta['prefill_compile_seconds']:.0f} s) | full: {full['text']!r} | correct: "
                + " ".join(f"{r['label']}={'Y' if r['correct'] else 'n'}" for r in res))
            if args.check_generate and not payload["checks"]:
                problems = check_against_generate(model, p.ids, combos, policies, res, args.max_new_tokens,
                                                  meta["tail_capacity"])
                payload["checks"].append({"length": L, "depth": d, "problems": problems})
                tqdm.write("check vs generate(): " + ("OK" if not problems else "; ".join(problems)))
    bar.close()
    payload["summary"] = summarize(runs, combos, args.lengths)
    payload["total_seconds"] = time.perf_counter() - t0
    payload["peak_rss_bytes"] = common.peak_rss_bytes()
    return payload


def summarize(runs: list[dict], combos, lengths) -> list[dict]:
    """One row per (length, combo): KV, rho, pooled decode timings, ratio to full, accuracy."""
    import numpy as np

    rows = []
    for L in lengths:
        full_ms = [1e3 * s for r in runs if r["length"] == L and r["policy"] == "full" for s in r["decode_seconds"]]
        full_p50 = statistics.median(full_ms) if full_ms else float("nan")
        full_mean = float(np.mean(full_ms)) if full_ms else float("nan")
        for name, rho in combos:
            rs = [r for r in runs if r["length"] == L and r["policy"] == name and r["rho"] == rho]
            if not rs:
                continue
            ms = [1e3 * s for r in rs for s in r["decode_seconds"]]
            p50 = statistics.median(ms) if ms else float("nan")
            mean = float(np.mean(ms)) if ms else float("nan")
            rows.append({
                "length": L, "policy": name, "rho": rho, "label": common.combo_label(name, rho),
                "achieved_rho": float(np.mean([r["achieved_rho"] for r in rs])),
                "achieved_rho_all": [r["achieved_rho"] for r in rs],
                "kv_bytes_prompt": int(np.mean([r["kv_bytes_prompt"] for r in rs])),
                "kv_bytes_tail": int(np.mean([r["kv_bytes_tail"] for r in rs])),
                "kv_bytes_device": int(np.mean([r["kv_bytes_device"] for r in rs])),
                "kv_bytes_host": int(np.mean([r["kv_bytes_host"] for r in rs])),
                "recalls": int(sum(r["recall_after_timing"].get("recalls", 0) for r in rs)),
                "drift_checks": int(sum(r["recall_after_timing"].get("drift_checks", 0) for r in rs)),
                "decode_ms_p50": p50, "decode_ms_mean": mean, "decode_steps_timed": len(ms),
                "decode_ratio_p50": p50 / full_p50 if full_ms and ms else float("nan"),
                "decode_ratio_mean": mean / full_mean if full_ms and ms else float("nan"),
                "correct": {f"{r['depth']:g}": r["correct"] for r in rs},
                "accuracy": float(np.mean([r["correct"] for r in rs])),
                "answers": {f"{r['depth']:g}": r["text"] for r in rs},
            })
    return rows


# ------------------------------------------------------------------ report
def results_table(summary: list[dict], depths) -> str:
    headers = ["prompt tok", "policy", "rho", "achieved rho", "KV prompt MiB", "KV tail MiB", "KV device MiB",
               "KV host MiB", "decode ms/tok (P50)", "vs full (P50)", "vs full (mean)", "recalls"]
    headers += [f"passkey d={d:g}" for d in depths] + ["accuracy"]
    rows = []
    for s in summary:
        rows.append([
            common.fmt_num(s["length"]), s["policy"], "—" if s["policy"] == "full" else f"{s['rho']:g}",
            common.fmt_num(s["achieved_rho"], 3),
            common.fmt_num(s["kv_bytes_prompt"] / MiB, 1), common.fmt_num(s["kv_bytes_tail"] / MiB, 1),
            common.fmt_num(s["kv_bytes_device"] / MiB, 1), common.fmt_num(s["kv_bytes_host"] / MiB, 1),
            common.fmt_num(s["decode_ms_p50"], 1), common.fmt_num(s["decode_ratio_p50"], 2),
            common.fmt_num(s["decode_ratio_mean"], 2),
            f"{s['recalls']} / {s['drift_checks']} checks" if s["drift_checks"] else "—",
            *[("yes" if s["correct"][f"{d:g}"] else "no") if f"{d:g}" in s["correct"] else "—" for d in depths],
            f"{sum(s['correct'].values())}/{len(s['correct'])}",
        ])
    return common.markdown_table(headers, rows, align="rllrrrrrrrrr" + "c" * len(depths) + "r")


def answers_table(payload: dict) -> str:
    """What full KV answered per prompt (the reference; shows what the model does with the whole prompt)."""
    rows = []
    for r in payload["runs"]:
        if r["policy"] == "full":
            rows.append([common.fmt_num(r["length"]), f"{r['depth']:g}", r["passkey"], repr(r["text"]),
                         "yes" if r["correct"] else "no"])
    return common.markdown_table(["prompt tok", "depth", "passkey", "full-KV answer", "correct"], rows, align="rrrlc")


def results_section(payload: dict, plot_rel: str | None) -> str:
    cfg = payload["config"]
    td = cfg.get("timing_depth", "all")
    timing_where = "every" if td == "all" else f"depth-{td:g}"
    lines = [
        common.section_header(f"Policies: {cfg['model']} KV, decode vs full KV, passkey accuracy", payload),
        "",
        f"Passkey prompts from `benchmarks/haystack.py` (real text: `pydoc_data.topics`; the needle "
        f"\"{haystack.PASSKEY_NEEDLE.format(key='K')}\" at each depth, then \"{haystack.PASSKEY_QUESTION}\" "
        "in the chat template; every prompt exactly its stated token count; passkey and haystack from "
        f"seed {cfg['seed']}). Batch 1, greedy, {cfg['dtype']}. Each prompt is prefilled once and every "
        "policy's selection hook runs on each layer's KV (prefill's forward pass does not depend on the "
        "policy; a policy's token scores, which never read the budget, are computed once for both budgets), "
        "giving each policy the cache `generate` would build (HeteroCache, which permutes heads, gets its "
        "own prefill). Then greedy decode steps run round-robin over all the policies' caches (order "
        "rotated each step) through `generate`'s decode engine (HeteroCache's drift checks and recalls "
        f"included): on the {timing_where} prompt of each length the first {cfg['warmup_steps']} step(s) "
        f"per cache are untimed warm-up and the next {cfg['decode_steps']} are timed (wall time incl. "
        "reading the token back; compile time excluded); the other prompts only decode their answers. "
        "'vs full' is the policy's median (mean) ms/token over full KV's median (mean) from the same "
        "interleaved steps. Correct iff the first "
        f"{cfg['max_new_tokens']} generated tokens contain the passkey. KV MiB: device arrays when the "
        "answer is complete, as `generate` reports them (prompt = the kept prompt rows of the row pool; tail = the rest of it, each head's rows for new tokens, "
        f"{payload['prompts'][0]['tail_capacity'] if payload['prompts'] else '?'} slots); achieved rho = "
        "prompt KV kept / full prompt KV. KV host: HeteroCache's satellites' full KV in pinned host memory; "
        "recalls: HeteroCache's drift-triggered recalls over all decode steps (timed ones included) / drift checks.",
        "",
        results_table(payload["summary"], cfg["depths"]),
        "",
        "Full-KV answers (the reference):",
        "",
        answers_table(payload),
        "",
        common.wall_and_memory_line(payload),
    ]
    if payload.get("checks"):
        c = payload["checks"][0]
        lines += ["", f"Check against `generate()` ({c['length']} tokens, depth {c['depth']:g}): "
                      + ("tokens, prompt KV bytes and achieved rho agree for every policy." if not c["problems"]
                         else "MISMATCH: " + "; ".join(c["problems"]))]
    lines += ["", common.plot_markdown("policies", plot_rel, cfg["plot"])]
    return "\n".join(lines)


def make_plot(payload: dict, path: Path) -> Path | None:
    summary = payload["summary"]
    import numpy as np

    cfg = payload["config"]
    lengths, depths, labels = cfg["lengths"], cfg["depths"], cfg["combos"]
    fig, axes = common.subplots(1, 3, figsize=(16, 0.42 * len(labels) + 2.6),
                                gridspec_kw={"width_ratios": [1.1, 1, 1]})
    # (a) accuracy grid: combos x (length, depth)
    ax = axes[0]
    cols = [(L, d) for L in lengths for d in depths]
    grid = np.full((len(labels), len(cols)), np.nan)
    for r in payload["runs"]:
        grid[labels.index(r["label"]), cols.index((r["length"], r["depth"]))] = float(r["correct"])
    ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels([f"{L}\nd={d:g}" for L, d in cols], fontsize=8)
    for i in range(len(labels)):
        for j in range(len(cols)):
            if np.isfinite(grid[i, j]):
                ax.text(j, i, "✓" if grid[i, j] else "✗", ha="center", va="center", fontsize=9)
    ax.set_title("Passkey correct (prompt tokens, needle depth)")
    # (b) decode ratio vs rho, (c) device KV MiB vs rho
    markers = ["o", "s", "^", "D"]
    pols = list(dict.fromkeys(s["policy"] for s in summary if s["policy"] != "full"))
    for k, (ax, key, ylab, title) in enumerate([
        (axes[1], "decode_ratio_p50", "decode ms/token / full KV's (median)", "Decode time vs full KV (same run)"),
        (axes[2], "kv_bytes_prompt", "prompt KV on device (MiB)", "Prompt KV on the device"),
    ]):
        for pi, pol in enumerate(pols):
            for li, L in enumerate(lengths):
                ss = sorted((s for s in summary if s["policy"] == pol and s["length"] == L), key=lambda s: s["rho"])
                if not ss:
                    continue
                ys = [s[key] / (MiB if key.startswith("kv") else 1) for s in ss]
                ax.plot([s["rho"] for s in ss], ys, marker=markers[li % 4], color=f"C{pi}",
                        ls="-" if li == 0 else "--", label=f"{pol} {L}" if k == 0 or li == 0 else None)
        for li, L in enumerate(lengths):
            f = [s for s in summary if s["policy"] == "full" and s["length"] == L]
            if f:
                y = f[0][key] / (MiB if key.startswith("kv") else 1)
                ax.plot([1.0], [y], marker=markers[li % 4], color="k", label=f"full {L}")
        if key == "decode_ratio_p50":
            ax.axhline(1.0, color="k", lw=0.8, alpha=0.5)
        ax.set_xlabel("budget rho")
        ax.set_ylabel(ylab)
        ax.set_title(title)
        ys_all = [y for line in ax.get_lines() for y in line.get_ydata() if np.isfinite(y)]
        ax.set_ylim(0, 1.18 * max(ys_all + [1.0]))
        ax.set_xlim(0, 1.05)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    sub = f"{cfg['model']}, {common.git_summary(payload['git'])}, {payload['machine'].get('cpu_model', '?')}"
    return common.save_figure(fig, path, f"KV-cache policies — {sub}")


# --------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    names = policy_names()
    p = common.argument_parser("Every KV-cache policy at each budget vs full KV on SmolLM2-135M: device KV bytes, "
                               "achieved rho, decode ms/token side by side with full KV, and passkey accuracy.")
    p.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS),
                   help="prompt lengths in tokens (the context is 8192: '8K' is 7900)")
    p.add_argument("--policies", nargs="+", default=names, type=common.policy_spec,
                   help="registered policies, optionally with options (quest:offload=true; full KV always runs once, as the reference)")
    p.add_argument("--budgets", type=float, nargs="+", default=list(DEFAULT_BUDGETS), help="budgets rho in (0, 1]")
    p.add_argument("--depths", type=float, nargs="+", default=list(DEFAULT_DEPTHS),
                   help="needle depths (fraction of the haystack)")
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per policy (timed prompts)")
    p.add_argument("--timing-depth", default="0.5",
                   help="decode is timed on the prompt with this needle depth (one per length; the other "
                        "prompts only decode their answers); 'all' times every prompt. Default: 0.5, or the "
                        "first of --depths when 0.5 is not among them")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed decode steps per policy and prompt first")
    p.add_argument("--max-new-tokens", type=int, default=12, help="answer tokens checked for the passkey")
    p.add_argument("--seed", type=int, default=0, help="passkey and haystack start")
    p.add_argument("--instruction", default=None,
                   help="optional text before the haystack (e.g. 'There is an important info hidden inside "
                        "a lot of irrelevant text. Find it and memorize it.'); default: none")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="model dtype (default: the loader's)")
    p.add_argument("--no-share-scores", action="store_true",
                   help="compute each policy's token scores once per budget instead of once per policy")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="do not use the persistent XLA compilation cache (compile time is excluded from "
                        "every timing either way; the cache only makes reruns start faster)")
    p.add_argument("--check-generate", action="store_true",
                   help="re-run generate() per policy on the first prompt and compare (costs one prefill each)")
    p.add_argument("--model", default=MODEL, help=argparse.SUPPRESS)
    common.add_output_arguments(p, "policies", SECTION, presets=False)
    args = p.parse_args(argv)
    args.plot = args.plot or args.out.with_suffix(".png")
    args.budgets = common.checked_budgets(p, args.budgets)
    if any(not 0.0 <= d <= 1.0 for d in args.depths):
        p.error("--depths must be in [0, 1]")
    if args.decode_steps < 1 or args.warmup_steps < 0 or args.max_new_tokens < 1:
        p.error("--decode-steps and --max-new-tokens must be >= 1, --warmup-steps >= 0")
    if any(n < 1 for n in args.lengths):
        p.error("--lengths must be positive")
    if args.timing_depth == "all":
        args.timing_depth = None
    else:
        try:
            td = float(args.timing_depth)
        except ValueError:
            p.error("--timing-depth: a depth or 'all'")
        args.timing_depth = td if td in args.depths else args.depths[0]
    return args


def main(argv=None) -> int:
    payload = common.run_task(parse_args(argv), run, section=SECTION, make_plot=make_plot,
                              results_section=results_section,
                              tables=lambda payload: [results_table(payload["summary"], payload["config"]["depths"]),
                                                      answers_table(payload)])
    return 1 if any(c["problems"] for c in payload["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())

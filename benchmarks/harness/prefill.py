"""The shared prefill of the grid scripts: one forward pass whose every layer feeds each policy's selection.

- :class:`SharedPrefill`: one layer-major prefill feeding the prefill plans of policies that share a head layout.
- :func:`make_engines`: one prefill per head layout; one decode ``Engine`` per policy (bench_policies,
  bench_fidelity, ``--prefill per-layout``).
- :class:`OneForwardPrefill`, :func:`build_engines`: one forward pass for every policy, whatever its head layout
  (bench_needle, bench_multiturn, bench_tasks).
- :func:`greedy_answer`: greedy tokens after a prefilled prompt, as ``generate`` decodes them.
"""

from __future__ import annotations

import dataclasses
import time


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
        # the plans are done; dropping them breaks the cycle plan -> compile_fn (compile_fn_sharing_scores's
        # closure) -> self -> plans, which kept each plan's host store (hundreds of MiB at 7.9K tokens) alive
        # until a full collection, long after its engine was gone
        self.builders, self.plans = [], []
        self._scores.clear()
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


class OneForwardPrefill:
    """One layer-major prefill feeding every policy's prefill plan, whatever its head layout.

    ``hetero_jax.model.transformer.prefill`` (run with the identity-layout params and ``DropKVPlan``) calls
    the ``observe(li, layer, x_in, k_buf, v_buf, lens)`` hook once per layer; a policy with a head layout
    gets ``layer`` from its permuted params and the KV heads of ``k_buf``/``v_buf`` in its layout order (a
    permuted model computes the same function, so ``x_in`` is shared). Each plan's ``build_layer`` output
    goes into its own ``cache.PoolBuilder`` (:class:`SharedPrefill`: ``start`` before the
    prefill, ``caches`` after it).
    """

    def __init__(self, plans, perms, layer_params, compile_fn, on_layer=None):
        self._shared = SharedPrefill(plans, compile_fn, on_layer)
        self.perms = perms  # per policy: per layer, an int array of KV heads in layout order, or None
        self.layer_params = layer_params  # per policy: its params["layers"]

    def __getattr__(self, name):  # plans, builders, hook_seconds, start, drop_plan, caches, compile_fn_sharing_scores
        return getattr(self._shared, name)

    def observe(self, li, layer, x_in, k_buf, v_buf, lens):
        import jax
        import jax.numpy as jnp

        s = self._shared
        jax.block_until_ready((x_in, k_buf, v_buf))  # the layer's forward pass is not the hooks' time
        s._scores.clear()
        permuted: dict = {}
        for i in range(len(s.plans)):
            if self.perms[i] is None:
                s.add(i, li, layer, x_in, k_buf, v_buf, lens)
                continue
            t0 = time.perf_counter()
            perm = self.perms[i][li]
            key = perm.tobytes()
            if key not in permuted:
                idx = jnp.asarray(perm)
                permuted[key] = jax.block_until_ready((jnp.take(k_buf, idx, axis=1), jnp.take(v_buf, idx, axis=1)))
            s.hook_seconds[i] += time.perf_counter() - t0
            k_p, v_p = permuted[key]
            s.add(i, li, self.layer_params[i][li], x_in, k_p, v_p, lens)
        if s.on_layer is not None:
            s.on_layer(li)


def build_engines(model, ids: list[int], policies, tail_capacity: int, *, prefill: str = "shared", bar=None,
                  share_scores: bool = True):
    """One decode ``Engine`` per policy for prompt ``ids``, as ``generate`` would build it.

    ``prefill``: ``"shared"`` (one forward pass for every policy and layout),
    ``"per-layout"`` (one per head layout: :func:`make_engines`) or
    ``"separate"`` (``Engine`` per policy). Returns (engines, info per policy).
    """
    from hetero_jax import runtime as G
    if prefill == "separate":
        engines, info = [], []
        for p in policies:
            t0 = time.perf_counter()
            engines.append(G.Engine(model, [list(ids)], p, tail_capacity=tail_capacity))
            info.append({"prefill": "separate", "prefill_group_wall_seconds": time.perf_counter() - t0})
        return engines, info
    if prefill == "per-layout":
        engines, info = make_engines(model, list(ids), policies, tail_capacity, bar, share_scores)
        for i in info:
            i["prefill"] = "per-layout"
        return engines, info
    if prefill != "shared":
        raise ValueError(f"prefill: 'shared', 'per-layout' or 'separate', got {prefill!r}")

    import jax
    import numpy as np

    from hetero_jax.model import layout as LY

    cfg = model.config
    bound = [G.bind_policy(model, p) for p in policies]
    layouts = [layout_key(p.layout(cfg)) for p in bound]
    params = [LY.params_for(model, lay) for lay in layouts]
    perms = [None if lay is None else [np.asarray(p, np.int32) for p in lay.perms] for lay in layouts]

    def on_layer(li):
        if bar is not None:
            bar.set_postfix_str(f"prefill ({len(bound)} policies, one forward pass): layer {li + 1}/{cfg.num_layers}")

    c0 = G.compile_seconds()
    t0 = time.perf_counter()
    shared = OneForwardPrefill([None] * len(bound), perms,
                               [p["layers"] for p in params], G.compiled, on_layer)
    fn = shared.compile_fn_sharing_scores() if share_scores else G.compiled
    plans = [p.make_prefill(cfg, [len(ids)], compile_fn=fn) for p in bound]  # checks budgets first
    shared._shared.plans = plans
    lens = [len(ids)]
    shared.start(cfg, lens, tail_capacity, model.params["embed"].dtype)
    logits, _ = G.prefill(model.params, cfg, [list(ids)], tail_capacity=1, plan=shared.drop_plan(cfg, lens),
                          observe=shared.observe)
    caches = shared.caches(np.asarray(lens, np.int32))
    jax.block_until_ready(logits)
    wall = time.perf_counter() - t0
    hooks = sum(shared.hook_seconds)
    engines, info = [], []
    for i, p in enumerate(bound):
        cache, state = caches[i]
        engines.append(G.Engine.from_prefilled(model, p, [len(ids)], params[i], logits, cache, state,
                                               prefill_seconds=wall - hooks + shared.hook_seconds[i]))
        info.append({"prefill": "shared", "layout": "identity" if layouts[i] is None else "permuted",
                     "prefill_forward_seconds": wall - hooks, "policy_prefill_seconds": shared.hook_seconds[i],
                     "prefill_group_wall_seconds": wall, "prefill_group_compile_seconds": G.compile_seconds() - c0})
    return engines, info


def greedy_answer(engine, max_new: int, eos) -> tuple[list[int], str]:
    """Greedy tokens after the prefilled prompt, as ``generate(max_new_tokens=max_new)`` decodes them."""
    tok = int(engine.first_tokens(0.0, 1.0)[0])
    out: list[int] = []
    while True:
        if tok in eos:
            return out, "eos"
        out.append(tok)
        if len(out) >= max_new:
            return out, "max_new_tokens"
        nxt, _ = engine.step([tok], 0.0, 1.0)
        tok = int(nxt[0])

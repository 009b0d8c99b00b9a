"""HeteroCache: role-aware budgets, host copies of the compressed heads, re-selection per turn, drift recall.

Prefill (per request, prompt length L):
- L_base by Eq. 7 over the whole model, l_i by Eq. 8 (``HeadProfile.budgets``);
- full heads (volatile, pivot) keep the whole prompt on the device;
- compressed heads (anchor, satellite) keep their top-l_i tokens by the pooled
  attention (GQA max) of the last ``select_window`` prompt queries, summed
  (causal), stored in position order. The paper scores by the last token alone
  (``select_window=1``); our default 16 reaches past the chat template's
  closing tokens into the question (docs/architecture.md);
- every compressed head's full prompt KV goes to pinned host memory (the paper
  keeps only the satellites'; the anchors' copy is what lets a later turn re-select);
- each pivot records K_base = the top-L_base of its pooled last-token attention.

A session's turn (``after_extend``, our departure): once a question has been appended
(chunked, ``model.extend``), every compressed head re-takes its top-l_i from its host
keys, scored by the pooled attention of the turn's queries exactly as prefill scores
its window (budgets unchanged), and each pivot's K_base restarts from the turn's last
query; this lands before the answer's first token is sampled. For a single request
(``generate``) nothing changes.

Decode: every ``window`` steps the buffered pivot queries are scored against
the pivot's prompt keys (``pallas_kernels.drift_check``); when the median
overlap with K_base, read against its chance level (o - c) / (1 - c) with
c = L_base / L (our departure: the raw overlap mostly measures rho), drops
below ``tau_drift``, each satellite of that pivot
gets its own top-l_s positions of the pivot's latest pooled scores, gathered
from the host copy and written into its device slots, and K_base moves on.

Copy window (ours, opt-in: ``copy_window=16``; one device): each compressed head gives its
``copy_window`` least-scored kept slots (at most a quarter of its l_i) to a window
that follows the profile's copy heads (duplicate-token heads the copy rule keeps
whole). Every step reports each copy head's most attended prompt position (its
pooled scores, read with its attention); when one moves one or two tokens on,
the answer is copying a span of the prompt, and the windows take the rows from
two tokens before it, from the host copy (rows a head holds already are skipped).
The window moves on once the pointer passes its middle. Until a copy is seen the
cache is exactly the selection without a window; a profile without copy heads
never moves it.

Asynchrony and lag: the check is dispatched right after step t's decode and
its small outputs (flags, indices) are copied to the host asynchronously;
they are read before step t + 1 is dispatched, where the recall is planned
and K_base moves on. Its rows are gathered on the host (numpy view of the
pinned array) and sent with ``device_put`` on a background thread while step
t + 1 runs, and written into the pool before step t + 2, which waits only
for transfers not yet done (the paper's AsyncUpdate: the transfers hidden
behind one decode step). So a recall takes effect exactly two steps after
its check, whatever the timing.

Modules, by concern; imports run one way, each only from those listed before it (and below the wing):

- ``counters``: the decode counters, one frozen record whose ``dataclasses.asdict`` is the stats;
- ``scores``: token scores of prefill's window, of a turn's queries, a pivot's K_base from one query;
- ``prefilled``: the record prefill hands decode, and the one call that writes compressed heads' rows from
  the host copy into the pool (``host_store.write_head_rows``: one device and a mesh alike);
- ``step``: the traced decode step (attention that also scores the pivots and copy heads, the pivots'
  statistics) and the drift check of every pivot at once;
- ``copy_window``: window slots, the rows a window takes, when a pointer moves it;
- ``recall``: the check's inputs, the top-set sizes a recall reads, the recall plan from a check's outputs;
- ``reselect``: the per-turn re-selection's scores and rows;
- ``inflight``: the recall in flight: its background send, its landing a step later, the decode state's
  recall hooks;
- ``decode``: ``HeteroDecode``, the per-request decode state that runs the hooks and holds the counters;
- ``prefill``: ``HeteroPrefill``, the prefill plan, whose ``finish`` makes the decode state;
- ``policy``: ``HeteroCache``, the frozen policy (its ``attend`` is ``step.attend_step``).
"""

from hetero_jax.policies.heterocache.counters import Counters
from hetero_jax.policies.heterocache.decode import HeteroDecode
from hetero_jax.policies.heterocache.policy import HeteroCache
from hetero_jax.policies.heterocache.prefill import HeteroPrefill
from hetero_jax.policies.heterocache.prefilled import HeteroPrefilled
from hetero_jax.policies.heterocache.step import drift_check

__all__ = ["Counters", "HeteroCache", "HeteroDecode", "HeteroPrefill", "HeteroPrefilled", "drift_check"]

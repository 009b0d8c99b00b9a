"""HeteroCache's decode counters: what ``HeteroDecode.stats`` reports, as one frozen record.

A state replaces its record on every count (``dataclasses.replace``), so a hook that fails keeps the record
it saved before it, and a session's checkpoint (which copies a state's containers, not its objects) holds
the counters as they were.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Counters:
    """The counters of one decode state; ``dataclasses.asdict`` gives its stats (one key per field, in order)."""

    # pivot checks read (pivots x checks): a check is counted when the step after it reads its result, so one
    # dispatched after an answer's last step, or dropped by a session turn, is not
    drift_checks: int = 0
    drift_triggers: int = 0  # pivot checks that drifted
    trigger_rate: float = dataclasses.field(default=0.0, init=False)  # drift_triggers / drift_checks (0 if none)
    recalls: int = 0  # satellite heads refreshed by a drift
    bytes_recalled: int = 0
    reselections: int = 0  # turns after which the compressed heads re-selected
    bytes_reselected: int = 0  # K/V bytes written to the device by those re-selections
    recall_failures: int = 0  # recalls dropped because their transfer failed
    recall_wait_s: float = 0.0  # host seconds the steps that landed recalls waited for their transfers
    copy_moves: int = 0  # times a sequence's copy window moved to a copied span
    bytes_copied: int = 0
    copy_failures: int = 0  # window fills dropped (filled again at the next step)
    reselect_failures: int = 0  # re-selections dropped because their transfer failed

    def __post_init__(self):
        rate = self.drift_triggers / self.drift_checks if self.drift_checks else 0.0
        object.__setattr__(self, "trigger_rate", rate)

    def add(self, **counts: int) -> "Counters":
        """A record with ``counts`` added to the fields they name."""
        return dataclasses.replace(self, **{k: getattr(self, k) + v for k, v in counts.items()})


def summary(c: Counters, placement: dict | None) -> str:
    """The counters (and, under tensor parallelism, the placement's balance) as one line of text."""
    text = (f"drift checks {c.drift_checks}, triggered {c.trigger_rate:.0%}, "
            f"recalls {c.recalls} ({c.bytes_recalled / 2**10:.0f} KiB)")
    if c.copy_moves:
        text += f", copy window moved {c.copy_moves}x ({c.bytes_copied / 2**10:.0f} KiB)"
    if c.reselections:
        text += f", re-selected {c.reselections}x ({c.bytes_reselected / 2**20:.1f} MiB)"
    p = placement
    if p:
        text += (f", tp {p['tp']}: kept max/mean {p['kept_max_over_mean']:.2f} (contiguous "
                 f"{p['contiguous_kept_max_over_mean']:.2f}), {p['allocated_tokens_per_shard']} prompt tokens "
                 f"allocated per shard (contiguous {p['contiguous_allocated_tokens_per_shard']}; "
                 f"{p['pool_rows_per_shard']} pool rows with the tails)")
    return text

"""HeteroCache's copy window (ours, opt-in, one device): each compressed head's least-scored kept slots follow
an answer that copies a span of the prompt, as the copy heads' pointers show it, with rows from the host copy.

Pure host-side planning: the decode state (``decode.HeteroDecode``) keeps the held positions and the window
starts, writes the rows this module names and counts them.
"""

from __future__ import annotations

import numpy as np

from hetero_jax.policies.heterocache.prefilled import HeteroPrefilled


def window_slots(kept_scores: np.ndarray, counts: np.ndarray, window: int) -> np.ndarray:
    """Each compressed head's copy-window slots: the slots of its ``w`` least-scored kept rows, w =
    min(window, count // 4) (a head keeps three quarters of its own selection at least), -1 past w.

    kept_scores: [B, Hc, cap] the selection scores of the rows in each slot; counts: [B, Hc] rows kept.
    Returns int64 [B, Hc, window], each head's slots in ascending score order (ties to the lower slot).
    """
    B, Hc, cap = kept_scores.shape
    out = np.full((B, Hc, window), -1, np.int64)
    for b in range(B):
        for j in range(Hc):
            c = int(counts[b, j])
            w = min(window, c // 4)
            if w:
                out[b, j, :w] = np.argsort(np.asarray(kept_scores[b, j, :c], np.float64), kind="stable")[:w]
    return out


def copy_rows(start: int, w: int, held: np.ndarray, prompt_len: int) -> np.ndarray:
    """The ``w`` prompt positions a copy window starting at ``start`` holds for a head whose other slots
    hold ``held`` (positions): the first w of start, start + 1, ..., prompt_len - 1, then start - 1, ...,
    0 that the head does not hold already (so no row is attended twice). Sorted, int64."""
    held = np.asarray(held, np.int64)
    s = min(max(0, int(start)), prompt_len)

    def free(a):  # a head holds thousands of rows, the window looks at a few dozen: compare those in a's span
        return a[~np.isin(a, held[(held >= a.min()) & (held <= a.max())])] if a.size else a

    for span in (4 * w, prompt_len):  # the near rows first; the whole prompt only if too many are held
        fwd = free(np.arange(s, min(prompt_len, s + span), dtype=np.int64))
        if len(fwd) >= w:
            return np.sort(fwd[:w])
        if s + span >= prompt_len:  # every row after start is in: the rest from start - 1 down
            back = free(np.arange(s - 1, max(-1, s - 1 - span), -1, dtype=np.int64))
            if len(fwd) + len(back) >= w or span >= prompt_len:
                return np.sort(np.concatenate([fwd, back[: w - len(fwd)]]))
    raise AssertionError("unreachable: the second span is the whole prompt")



def moved_windows(ptr: np.ndarray, prev: np.ndarray | None, window_start: np.ndarray,
                  window: int) -> tuple[np.ndarray, list[int]]:
    """(the new window starts [B], the sequences whose window moved, in order): ptr, prev [B, Nc] the copy heads'
    most attended prompt positions at the last step and the step before (prev None: no step before);
    window_start [B] each window's first prompt row (-1: no copy seen). A pointer one or two tokens past the
    step before's shows a copy from there (the first such copy head counts); the window moves to two tokens
    before it unless the pointer is still inside its first half."""
    window_start, moved = window_start.copy(), []
    if prev is None:
        return window_start, moved
    for b in range(len(ptr)):
        adv = ptr[b] - prev[b]
        hits = np.flatnonzero((adv >= 1) & (adv <= 2))
        if not hits.size:
            continue
        c = int(ptr[b, hits[0]])
        start = window_start[b]
        if start < 0 or c < start + 2 or c > start + window // 2:
            window_start[b] = max(0, c - 2)
            moved.append(b)
    return window_start, moved


def window_rows(prefilled: HeteroPrefilled, held: list, win: list, window_start: np.ndarray, dirty) -> list[tuple]:
    """The rows that fill the windows of the sequences ``dirty``: (layer, b, compressed head j, its window slots
    [w] ascending, the prompt rows they take [w]) for each head whose window does not hold them already.

    held, win: per layer [B, Hc, cap] the positions each head's slots hold and [B, Hc, W] its window slots
    (None for a layer without compressed heads); the rows are ``copy_rows`` from ``window_start[b]``."""
    items = []
    for li in range(len(prefilled.roles)):
        if not held or held[li] is None:
            continue
        for b in sorted(dirty):
            T = int(prefilled.lens[b])
            for j in range(held[li].shape[1]):
                slots = win[li][b, j]
                slots = np.sort(slots[slots >= 0])
                if not slots.size:
                    continue
                c = int(prefilled.counts[li][b, j])
                want = copy_rows(int(window_start[b]), len(slots), np.delete(held[li][b, j, :c], slots), T)
                if np.array_equal(np.sort(held[li][b, j, slots]), want):
                    continue
                items.append((li, b, j, slots, want))
    return items


def update_held(held: list, win: list, updates: list) -> list[int]:
    """Record recalled rows in the held positions and window slots (``recall.plan_recall``'s updates: (layer,
    b, compressed head j, its new positions, its new window slots)), in place; returns each update's b."""
    for li, b, j, pos, slots in updates:
        held[li][b, j, : len(pos)] = pos
        win[li][b, j, : len(slots)] = slots
    return [u[1] for u in updates]

"""Decode steps of the engine's schedules, counted on the host from completion lengths alone.

A decode step advances every occupied slot by one token, and at 7B on a GPU its time hardly
depends on how many slots are occupied (it reads the weights once), so the decode steps a
schedule takes are its decode time in units of one step. bench/scale.py multiplies them by its
projected token step; bench/rollout.py measures the same schedules on a model. The counts
follow opsd_jax/sampling/engine.py: a completion of n tokens occupies its slot for n + 1 steps
(the last draws its end, or the cap is reached), a free slot takes the next waiting prompt at
once, and a step's rollout ends when its last row does (rows of later steps then pause).
"""

from __future__ import annotations

import collections

import numpy as np


def exponential_lengths(count: int, mean: float, cap: int, seed: int) -> np.ndarray:
    """`count` completion lengths, exponential with `mean`, rounded, in 1..cap (seeded)."""
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.exponential(mean, count)), 1, cap).astype(np.int64)


def static_steps(lengths: np.ndarray, rows: int) -> int:
    """Consecutive batches of `rows`, each decoded until its longest row ends."""
    return int(sum(lengths[i : i + rows].max() + 1 for i in range(0, len(lengths), rows)))


def stream_steps(lengths: np.ndarray, slots: int) -> int:
    """Every prompt through `slots` slots, a freed slot refilled at once (evaluation)."""
    free_at = np.zeros(slots, np.int64)  # the step each slot frees up at
    for n in lengths:
        slot = int(np.argmin(free_at))
        free_at[slot] += n + 1
    return int(free_at.max())


def training_steps(lengths: np.ndarray, rows: int, lookahead: int) -> np.ndarray:
    """Decode steps of each training step's rollout: `rows` prompts a step, `rows` slots, the
    next `lookahead` steps' prompts queued behind each step's (trainer/rollout.py)."""
    steps = len(lengths) // rows
    queue: collections.deque[tuple[int, int]] = collections.deque()  # (step, tokens left)
    slots: list[list[int] | None] = [None] * rows  # [step, steps left] of the slot's row
    queued, per_step = 0, np.zeros(steps, np.int64)
    for step in range(steps):
        while queued <= min(step + lookahead, steps - 1):
            queue.extend((queued, int(n) + 1) for n in lengths[queued * rows : (queued + 1) * rows])
            queued += 1

        def left() -> bool:
            return any(s == step for s, _ in queue) or any(r and r[0] == step for r in slots)

        elapsed = 0
        while left():
            for i, row in enumerate(slots):
                if row is None and queue:
                    slots[i] = list(queue.popleft())
            advance = min(r[1] for r in slots if r is not None)
            elapsed += advance
            for i, row in enumerate(slots):
                if row is not None:
                    row[1] -= advance
                    if row[1] == 0:
                        slots[i] = None
        per_step[step] = elapsed
    return per_step

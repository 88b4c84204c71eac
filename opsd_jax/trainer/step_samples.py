"""Each step's samples, taken from the data iterator up to `ahead` steps early.

The rollout's lookahead (config.rollout_lookahead) starts the next steps' prompts while the
current step's rows still decode, so their samples are read before their step comes. What a
checkpoint saves with a step is the iterator's state (and the data counters) right after that
step's own samples: a resume takes the samples read ahead again, and samples them anew with the
resumed weights.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class StepSamples:
    """One step's samples, with the iterator's state and counters right after them."""

    step: int
    samples: list
    data_state: dict[str, Any]
    data_metrics: dict[str, int]


class SampleQueue:
    """Takes `per_step` samples a step from `data`, `ahead` steps early (never for a step at
    or past `total_steps`)."""

    def __init__(self, data, per_step: int, ahead: int, total_steps: int):
        self.data, self.per_step, self.ahead, self.total_steps = data, per_step, ahead, total_steps
        self._queue: collections.deque[StepSamples] = collections.deque()

    def _take(self, step: int) -> StepSamples:
        samples = self.data.take(self.per_step)
        return StepSamples(step, samples, self.data.get_state(), self.data.metrics())

    def take(self, step: int) -> StepSamples:
        """Step `step`'s samples (steps are taken in order), the next `ahead` steps' read too."""
        if self._queue and self._queue[0].step != step:
            raise ValueError(
                f"SampleQueue.take({step}): the next step queued is {self._queue[0].step}"
            )
        if not self._queue:
            self._queue.append(self._take(step))
        while len(self._queue) <= self.ahead and self._queue[-1].step + 1 < self.total_steps:
            self._queue.append(self._take(self._queue[-1].step + 1))
        return self._queue.popleft()

    def upcoming(self) -> list[StepSamples]:
        """The steps read ahead, in order (what the rollout may start early)."""
        return list(self._queue)

"""The run's rollout (opsd_jax/trainer/rollout.py): the lookahead's staleness bound and the sample
queue that reads steps early. A tiny run with rollout_lookahead=1, on one process and on two,
is tests/test_multihost.py's."""

import numpy as np
import pytest

from opsd_jax.sampling.sampler import Completions
from opsd_jax.trainer.rollout import StaleRolloutError, check_staleness, completion_scalars
from opsd_jax.trainer.step_samples import SampleQueue


def test_staleness_is_measured_and_a_token_past_the_bound_is_refused():
    versions = np.array([[3, 3, 4, 4, -1], [4, 4, 4, -1, -1]])  # step 4's rows; -1: past the end
    fraction, most = check_staleness(versions, step=4, lookahead=1)
    assert fraction == pytest.approx(2 / 7) and most == 1
    assert check_staleness(np.full((2, 3), 5), step=5, lookahead=0) == (0.0, 0)
    with pytest.raises(StaleRolloutError, match="policy versions 3..4; rollout_lookahead=0"):
        check_staleness(versions, step=4, lookahead=0)
    with pytest.raises(StaleRolloutError):  # a token from a later policy than the step's
        check_staleness(np.array([[5, 5]]), step=4, lookahead=1)


def test_the_step_log_counts_empty_completions():
    """A completion whose first token is <|im_end|> is trained as one EOS row; the step log
    says how often that happens (the seed resamples it instead: docs/opsd_loss.md §a.5)."""
    lengths = np.array([0, 3, 0, 5])
    completions = Completions(
        tokens=np.zeros((4, 6), np.int32),
        lengths=lengths,
        logprobs=np.zeros((4, 6), np.float32),
        finished=np.array([True, True, True, False]),
        rounds=np.array([1, 2, 1, 1]),
    )
    scalars = completion_scalars(completions)
    assert scalars["completion_empty"] == 0.5
    assert scalars["completion_length"] == 2.0 and scalars["completion_finished"] == 0.75
    assert scalars["image_skip_rounds"] == 0.25


class CountingData:
    """A data iterator of consecutive integers; its state is how many it has yielded."""

    def __init__(self):
        self.num_yielded = 0

    def take(self, n):
        first, self.num_yielded = self.num_yielded, self.num_yielded + n
        return list(range(first, first + n))

    def get_state(self):
        return {"num_yielded": self.num_yielded}

    def metrics(self):
        return {"data/num_yielded": self.num_yielded}


def test_the_sample_queue_reads_ahead_and_saves_each_steps_own_state():
    data = CountingData()
    queue = SampleQueue(data, per_step=2, ahead=2, total_steps=4)
    first = queue.take(0)
    assert first.samples == [0, 1] and first.data_state == {"num_yielded": 2}
    assert [u.step for u in queue.upcoming()] == [1, 2] and data.num_yielded == 6
    assert queue.take(1).samples == [2, 3]
    assert [u.step for u in queue.upcoming()] == [2, 3]  # step 4 is past the run: never read
    assert queue.take(2).data_state == {"num_yielded": 6}  # its own, not the read-ahead's
    assert queue.take(3).samples == [6, 7] and data.num_yielded == 8
    skipping = SampleQueue(CountingData(), per_step=2, ahead=1, total_steps=9)
    skipping.take(4)  # step 5 is read ahead
    with pytest.raises(ValueError, match="take\\(6\\): the next step queued is 5"):
        skipping.take(6)
    no_lookahead = SampleQueue(CountingData(), per_step=3, ahead=0, total_steps=9)
    assert no_lookahead.take(0).samples == [0, 1, 2] and no_lookahead.upcoming() == []

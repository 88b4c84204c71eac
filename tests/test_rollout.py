"""The run's rollout (opsd_jax/trainer/rollout.py): the lookahead's staleness bound, the sample
queue that reads steps early, a tiny run with rollout_lookahead=1 that trains on stale tokens
only within the bound, and the same with two processes against one."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from conftest import run_python

from opsd_jax.trainer.rollout import StaleRolloutError, check_staleness
from opsd_jax.trainer.step_samples import SampleQueue

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_staleness_is_measured_and_a_token_past_the_bound_is_refused():
    versions = np.array([[3, 3, 4, 4, -1], [4, 4, 4, -1, -1]])  # step 4's rows; -1: past the end
    fraction, most = check_staleness(versions, step=4, lookahead=1)
    assert fraction == pytest.approx(2 / 7) and most == 1
    assert check_staleness(np.full((2, 3), 5), step=5, lookahead=0) == (0.0, 0)
    with pytest.raises(StaleRolloutError, match="policy versions 3..4; rollout_lookahead=0"):
        check_staleness(versions, step=4, lookahead=0)
    with pytest.raises(StaleRolloutError):  # a token from a later policy than the step's
        check_staleness(np.array([[5, 5]]), step=4, lookahead=1)


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


@pytest.mark.slow
def test_a_lookahead_run_trains_on_tokens_at_most_one_update_old(tmp_path):
    """configs/tiny.py with rollout_lookahead=1: some steps train on tokens drawn with the
    previous weights (the lookahead is used), none on older ones, and the first step on none."""
    result = run_python(
        "train.py",
        "--config",
        "configs/tiny.py",
        f"--config.results_dir={tmp_path}",
        "--config.total_steps=5",
        "--config.eval_every=0",
        "--config.log_every=1",
        "--config.rollout_lookahead=1",
        "--config.progress_bar=False",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "lookahead 1: the next 1 step(s)' prompts take freed slots" in result.stdout
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "rollout/staleness_max" in s]
    assert len(steps) == 5
    assert steps[0]["rollout/staleness_max"] == 0 and steps[0]["rollout/stale_token_fraction"] == 0
    assert all(s["rollout/staleness_max"] <= 1 for s in steps)
    assert any(s["rollout/stale_token_fraction"] > 0 for s in steps), steps
    assert all(0 < s["rollout/slot_occupancy"] <= 1 for s in steps)


@pytest.mark.slow
def test_two_processes_with_lookahead_train_like_one_process(tmp_path):
    """configs/tiny.py with rollout_lookahead=1 on a 2 x 4 mesh: two processes (each reading
    its share of every step ahead, the engine's host loop on each) train what one process
    driving all 8 devices trains, while later steps' rows do start early."""
    from test_multihost import _env, _free_port, _max_difference, _params, _wait

    common = [
        *("--config", "configs/tiny.py", "--config.total_steps=3", "--config.eval_every=0"),
        *("--config.save_every=1", "--config.max_checkpoints=3", "--config.log_every=1"),
        *("--config.progress_bar=False", "--config.num_replicate=2", "--config.num_shard=4"),
        *("--config.rollout_lookahead=1", "--config.attention_backend=reference"),
        # As tests/test_multihost.py: a full, constant lr and an eps above float noise.
        *("--config.warmup_steps=0", "--config.lr_scheduler=constant", "--config.eps=1e-6"),
    ]
    single, multi = tmp_path / "single", tmp_path / "multi"
    port = _free_port()
    launch = lambda argv, devices: subprocess.Popen(  # noqa: E731
        [sys.executable, "train.py", *common, *argv],
        cwd=ROOT,
        env=_env(devices),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    processes = [
        launch(
            [
                f"--config.results_dir={multi}",
                "--config.distributed=True",
                f"--config.coordinator_address=127.0.0.1:{port}",
                "--config.num_processes=2",
                f"--config.process_id={i}",
            ],
            4,
        )
        for i in range(2)
    ]
    reference = launch([f"--config.results_dir={single}"], 8)
    first, _ = _wait(processes)
    _wait([reference])
    assert "2 processes, 4 devices each" in first and "step 3/3" in first
    logged = [json.loads(line) for line in (multi / "metrics.jsonl").read_text().splitlines()]
    assert any(s.get("rollout/stale_token_fraction", 0) > 0 for s in logged), logged
    for step in (1, 2, 3):
        difference = _max_difference(
            _params(single / "checkpoints", step), _params(multi / "checkpoints", step)
        )
        assert difference <= 1e-6, f"step {step}: {difference}"

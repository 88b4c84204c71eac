"""Multi-host training on JAX's distributed runtime, with two local processes standing in for hosts.

Two `train.py` processes (4 CPU devices each, coordinator on 127.0.0.1) train the tiny config
with rollout_lookahead=1 on a 2 x 4 mesh, each reading, sampling and packing only its own share
of every step (and of the step ahead). The result must equal one process driving all 8 devices
over the same data stream; that one-process run is also the check of the lookahead itself
(opsd_jax/trainer/rollout.py): tokens at most one update old, some of them used. A second
two-process launch restores the checkpoint both processes wrote (orbax's multi-process save and
restore). Three steps, and the second launch trains nothing: every training launch compiles the
whole step for 8 devices, which is most of a minute on a 2-core CI machine. One run pair serves
all of it: each launch of this kind costs that compile again, per process.
"""

import json
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest
from conftest import subprocess_env

# A slow file (train.py processes): outside the fast tier, pytest -m 'not slow'.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]

COMMON = [
    *("--config", "configs/tiny.py", "--config.total_steps=3", "--config.eval_every=0"),
    *("--config.save_every=1", "--config.max_checkpoints=3", "--config.log_every=1"),
    *("--config.progress_bar=False", "--config.num_replicate=2", "--config.num_shard=4"),
    # The stage-1 toy model finishes its answers, so the engine frees slots that the next
    # step's prompts take (a random model's completions run to the cap and free none).
    "--config.rollout_lookahead=1",
    # Full lr from step 1; eps well above float noise: with the recipe's eps=1e-15 Adam turns a
    # last-bit difference in a ~0 gradient entry (summation order: the runs pack rows
    # differently) into a full +-lr step, which would hide what this test is about.
    *("--config.warmup_steps=0", "--config.lr_scheduler=constant", "--config.eps=1e-6"),
    # The dense-mask attention compiles in two thirds of the time of the default flash-style
    # backend; this test is about distribution.
    "--config.attention_backend=reference",
]


def _env(devices: int) -> dict:
    return dict(subprocess_env(devices), JAX_PLATFORMS="cpu")


def _launch(results_dir, devices: int, *extra) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "train.py", *COMMON, f"--config.results_dir={results_dir}", *extra],
        cwd=ROOT,
        env=_env(devices),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_two_processes(results_dir):
    port = _free_port()
    return [
        _launch(
            results_dir,
            4,
            "--config.distributed=True",
            f"--config.coordinator_address=127.0.0.1:{port}",
            "--config.num_processes=2",
            f"--config.process_id={i}",
        )
        for i in range(2)
    ]


def _wait(processes, timeout=600):
    outputs = []
    try:
        for p in processes:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in processes:
            p.kill()
    for i, (p, out) in enumerate(zip(processes, outputs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
    return outputs


def _params(checkpoint_dir, step):
    import jax
    import orbax.checkpoint as ocp

    # Saved from 8 devices (in one or two processes): restore every array onto one device.
    path = checkpoint_dir / str(step) / "params"
    checkpointer = ocp.StandardCheckpointer()
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        checkpointer.metadata(path).item_metadata,
    )
    restored = checkpointer.restore(path, target)
    flat = {}

    def visit(prefix, node):
        if isinstance(node, dict):
            for k, v in node.items():
                visit(f"{prefix}/{k}", v)
        else:
            flat[prefix] = np.asarray(node)

    visit("", restored)
    return flat


def _max_difference(a, b):
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def test_two_processes_with_lookahead_train_like_one_process_and_restore(tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    # The one-process reference runs while the first two-process launch does (2 cores).
    reference = _launch(single, 8)
    first = _wait(_start_two_processes(multi))
    (reference_output,) = _wait([reference])
    assert "step 3/3" in reference_output
    assert "2 processes, 4 devices each" in first[0]
    assert "step 3/3" in first[0] and "step 3/3" not in first[1]  # only the main one logs
    for step in (1, 2, 3):
        assert (multi / "checkpoints" / str(step) / "commit_success.txt").exists()

    # The lookahead, in the one-process run: later steps' rows start early (some tokens come
    # from the weights before the last update), none from older weights, the first step none.
    assert "lookahead 1: the next 1 step(s)' prompts take freed slots" in reference_output
    steps = [json.loads(line) for line in (single / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "rollout/staleness_max" in s]
    assert len(steps) == 3
    assert steps[0]["rollout/staleness_max"] == 0 and steps[0]["rollout/stale_token_fraction"] == 0
    assert all(s["rollout/staleness_max"] <= 1 for s in steps)
    assert any(s["rollout/stale_token_fraction"] > 0 for s in steps), steps
    assert all(0 < s["rollout/slot_occupancy"] <= 1 for s in steps)
    # ... and in the two-process run, each process's engine reading its share ahead.
    logged = [json.loads(line) for line in (multi / "metrics.jsonl").read_text().splitlines()]
    assert any(s.get("rollout/stale_token_fraction", 0) > 0 for s in logged), logged

    # A second launch of both restores the state they wrote together (each process its shards
    # and its own data-iterator state); nothing is left to train, so nothing is compiled.
    second = _wait(_start_two_processes(multi))
    assert "at step 3" in second[0] and "nothing left to train" in second[0], second[0][-2000:]
    assert "compiling the train step" not in second[0], second[0][-2000:]

    for step in (1, 2, 3):
        difference = _max_difference(
            _params(single / "checkpoints", step), _params(multi / "checkpoints", step)
        )
        print(f"step {step}: max |params(2 processes) - params(1 process)| = {difference:.3g}")
        assert difference <= 1e-6, f"step {step}: {difference}"


def test_pad_pack_adds_inert_padding_only():
    from models.pack import pack_sizes, pad_pack
    from opsd_jax.data.packing import Image, SpecialTokens, Text, pack_samples

    special = SpecialTokens(im_start=1, im_end=2, vision_start=3, vision_end=4)
    image = Image(np.ones((4, 588), np.float32), np.arange(4, dtype=np.int32))
    samples = [[image, Text([7, 8]), Text([9], loss=True)], [Text([5, 6, 7], loss=True)]]
    pack = pack_samples(samples, row_length=16, num_rows=2, special=special)
    padded = pad_pack(pack, 32, 8, 6)
    assert pack_sizes(padded) == (32, 8, 6)
    for name in (
        "tokens",
        "positions",
        "segment_ids",
        "k_start",
        "k_end",
        "loss_rows",
        "loss_targets",
        "loss_mask",
        "loss_sample",
        "vit_patches",
        "vit_slots",
    ):
        before, after = getattr(pack, name), getattr(padded, name)
        width = before.shape[1]
        np.testing.assert_array_equal(after[:, :width], before)  # content untouched
        expected = -1 if name == "vit_slots" else 0
        assert (after[:, width:] == expected).all(), name  # padding: empty / no-op values
    with pytest.raises(ValueError, match="cannot pad"):
        pad_pack(pack, 8, 8, 6)
    # A pack already at the sizes (a fixed-shape training pack) keeps its arrays: no copy of its
    # ViT patches (hundreds of MB a pack at the recipe's shapes) on the step's path.
    same = pad_pack(padded, *pack_sizes(padded))
    assert same.vit_patches is padded.vit_patches and same.tokens is padded.tokens


def test_a_data_check_refused_on_one_host_stops_every_process_in_one_line(tmp_path):
    """Process 1's data copy is missing (an empty dataset folder where the toy data goes): it
    refuses, and process 0, whose data is fine, stops too with one line instead of going on
    alone into a collective that never completes."""
    port = _free_port()
    (tmp_path / "p1" / "toy" / "data" / "toy_majority").mkdir(parents=True)
    processes = [
        _launch(
            tmp_path / f"p{i}",
            4,
            "--config.distributed=True",
            f"--config.coordinator_address=127.0.0.1:{port}",
            "--config.num_processes=2",
            f"--config.process_id={i}",
        )
        for i in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in processes]
    finally:
        for p in processes:
            p.kill()
    assert [p.returncode for p in processes] == [2, 2], outputs
    assert "no parquet or jsonl files under" in outputs[1], outputs[1][-3000:]
    assert "another process refused its data (see its output)" in outputs[0], outputs[0][-3000:]
    assert "Traceback" not in outputs[0] + outputs[1]

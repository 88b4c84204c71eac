"""Tests for opsd_jax.training.metrics: window averaging, the sinks (console, JSONL, TensorBoard events read
back with EventAccumulator), phase timings, non-main silence, the missing-wandb fallback and
device-array values. A fake clock makes throughput, ETA and phase numbers exact."""

import json
import math
import re
import sys
import types

import jax.numpy as jnp
import pytest
from conftest import run_python
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from opsd_jax.training import metrics
from opsd_jax.training.metrics import MetricsLogger, format_duration, format_number, wandb_run_id


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(metrics, "_now", c)
    return c


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _accumulator(logdir):
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return acc


def _run_ten_steps(logger, clock, as_jax=False):
    """Steps 1..10: loss = step, lr = step / 10, 0.3 s of "sample" and 0.1 s of "step" each."""
    returned = []
    for step in range(1, 11):
        with logger.phase("sample"):
            clock.t += 0.3
        with logger.phase("step"):
            clock.t += 0.1
        loss, lr = float(step), step / 10
        if as_jax:
            loss, lr = jnp.float32(loss), jnp.asarray(lr, jnp.float32)
        returned.append(logger.log_step(step, {"loss": loss, "lr": lr}, samples=4, tokens=100))
    return returned


def test_averages_written_to_every_sink(tmp_path, clock, capsys):
    logger = MetricsLogger(str(tmp_path), total_steps=10, log_every=5, progress_bar=False)
    returned = _run_ten_steps(logger, clock)
    logger.close()

    logged = [r for r in returned if r is not None]
    assert [i for i, r in enumerate(returned) if r is not None] == [4, 9]
    assert logged[0]["loss"] == pytest.approx(3.0) and logged[1]["loss"] == pytest.approx(8.0)
    assert logged[0]["lr"] == pytest.approx(0.3) and logged[1]["lr"] == pytest.approx(0.8)
    # 5 steps in 2.0 s of fake time, 20 samples and 500 tokens per window.
    assert logged[0]["perf/steps_per_sec"] == pytest.approx(2.5)
    assert logged[0]["perf/samples_per_sec"] == pytest.approx(10.0)
    assert logged[0]["perf/tokens_per_sec"] == pytest.approx(250.0)
    assert logged[0]["perf/eta_sec"] == pytest.approx(0.4 * 5)
    assert logged[1]["perf/eta_sec"] == pytest.approx(0.0)
    assert logged[0]["time/sample_sec"] == pytest.approx(0.3)
    assert logged[0]["time/sample_fraction"] == pytest.approx(0.75)
    assert logged[0]["time/sample_fraction"] + logged[0]["time/step_fraction"] == pytest.approx(1)

    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "step 5/10 | loss 3 | lr 0.3 | 2.5 steps/s | 10 samples/s | 250 tok/s | "
        + "sample 75% step 25% | ETA 2s",
        "step 10/10 | loss 8 | lr 0.8 | 2.5 steps/s | 10 samples/s | 250 tok/s | "
        + "sample 75% step 25% | ETA 0s",
    ]

    rows = _read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [5, 10]
    assert [r["loss"] for r in rows] == pytest.approx([3.0, 8.0])
    assert rows[1]["time/step_fraction"] == pytest.approx(0.25)

    acc = _accumulator(tmp_path)
    tags = set(acc.Tags()["scalars"])
    assert {
        "loss",
        "lr",
        "perf/steps_per_sec",
        "perf/samples_per_sec",
        "perf/tokens_per_sec",
    } <= tags
    assert {"perf/eta_sec", "time/sample_sec", "time/step_fraction"} <= tags
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [5, 10]
    assert [e.value for e in loss] == pytest.approx([3.0, 8.0])
    fractions = [acc.Scalars(f"time/{p}_fraction")[0].value for p in ("sample", "step")]
    assert sum(fractions) == pytest.approx(1.0, abs=1e-6)


def test_the_mfu_is_the_windows_model_flops_over_its_time_and_the_peak(tmp_path, clock, capsys):
    """On a GPU whose peak is known: MaxText's MFU over the window's wall time, on the console
    and in every sink; without a peak (a CPU) no MFU is logged."""
    logger = MetricsLogger(
        str(tmp_path), total_steps=4, log_every=2, progress_bar=False, peak_flops=1e12
    )
    for step in (1, 2):
        clock.t += 0.5
        logger.log_step(step, {"loss": 1.0}, model_flops=1.5e11)
    logger.close()
    row = _read_jsonl(tmp_path / "metrics.jsonl")[0]
    assert row["perf/mfu"] == pytest.approx(3e11 / 1.0 / 1e12)  # 2 steps in 1 s
    assert "| MFU 30.0% |" in capsys.readouterr().out
    plain = MetricsLogger(None, total_steps=2, log_every=2, progress_bar=False)
    clock.t += 1.0
    assert "perf/mfu" not in plain.log_step(2, {"loss": 1.0}, model_flops=1.5e11, force=True)


def test_data_and_total_keys_take_latest_value_and_max_keys_the_largest(tmp_path, clock):
    logger = MetricsLogger(str(tmp_path), total_steps=100, log_every=5, progress_bar=False)
    skipped = [1, 1, 2, 3, 5]
    for step, count in enumerate(skipped, start=1):
        out = logger.log_step(
            step,
            {
                "loss": float(step),
                "data/skipped/too_long": count,
                "tokens_total": 10 * step,
                "rollout/staleness_max": float(step == 2),  # a bound: the window's largest
            },
        )
    logger.close()
    assert out["data/skipped/too_long"] == 5
    assert out["tokens_total"] == 50
    assert out["rollout/staleness_max"] == 1.0
    assert out["loss"] == pytest.approx(3.0)
    assert _read_jsonl(tmp_path / "metrics.jsonl")[0]["data/skipped/too_long"] == 5


def test_a_per_token_mean_is_weighed_by_its_tokens_and_a_step_without_any_left_out(tmp_path, clock):
    """A source's jsd (NaN in a step without its samples) over a window: the steps' values
    weighed by the tokens beside them, not a plain mean that one NaN step spoils."""
    logger = MetricsLogger(str(tmp_path), total_steps=100, log_every=4, progress_bar=False)
    steps = [(0.2, 10.0), (0.4, 30.0), (0.1, 20.0), (math.nan, 0.0)]  # (jsd, tokens)
    for step, (jsd, tokens) in enumerate(steps, start=1):
        out = logger.log_step(
            step,
            {
                "source/b/jsd": jsd,
                "source/b/tokens": tokens,
                "source/c/jsd": math.nan,
                "source/c/tokens": 0.0,
            },
        )
    logger.close()
    assert out["source/b/jsd"] == pytest.approx((0.2 * 10 + 0.4 * 30 + 0.1 * 20) / 60)
    assert out["source/b/tokens"] == pytest.approx(15.0)  # tokens per step
    assert math.isnan(out["source/c/jsd"]) and out["source/c/tokens"] == 0.0


def test_force_and_last_step_log(tmp_path, clock, capsys):
    logger = MetricsLogger(None, total_steps=7, log_every=5, progress_bar=False)
    out = [logger.log_step(s, {"loss": 1.0}, force=(s == 2)) for s in range(1, 8)]
    logger.close()
    assert [s for s, r in zip(range(1, 8), out) if r is not None] == [2, 5, 7]
    assert len(capsys.readouterr().out.splitlines()) == 3


def test_non_main_writes_nothing(tmp_path, clock, capsys):
    logdir = tmp_path / "run"
    logger = MetricsLogger(
        str(logdir), total_steps=10, log_every=1, is_main=False, wandb={"project": "x"}
    )
    with logger.phase("sample"):
        clock.t += 1
    assert logger.log_step(1, {"loss": 1.0}, force=True) is None
    logger.log_text(1, "sample", "hello")
    logger.close()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    assert not logdir.exists()


def test_wandb_missing_warns_and_continues(tmp_path, clock, capsys, monkeypatch):
    # A None entry in sys.modules makes `import wandb` raise ImportError even if it is installed.
    monkeypatch.setitem(sys.modules, "wandb", None)
    logger = MetricsLogger(
        str(tmp_path), total_steps=2, log_every=1, progress_bar=False, wandb={"project": "p"}
    )
    assert logger.log_step(1, {"loss": 2.0})["loss"] == 2.0
    logger.close()
    out = capsys.readouterr().out
    assert out.count("WARNING") == 1 and "wandb" in out


class FakeWandb(types.ModuleType):
    """A stand-in `wandb` module (the real one is optional and not installed): records init
    kwargs and logged records."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged = [], []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return types.SimpleNamespace(
            log=lambda record, step: self.logged.append((step, record)), finish=lambda: None
        )


def test_wandb_gets_the_run_id_and_resume_mode(tmp_path, clock, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    options = {"project": "p", "name": "n", "id": "abc123", "resume": "allow"}
    logger = MetricsLogger(
        str(tmp_path),
        total_steps=4,
        start_step=2,
        log_every=1,
        progress_bar=False,
        wandb=options,
        config={"lr": 1.0},
    )
    logger.log_step(3, {"loss": 2.0})
    logger.close()
    (init,) = fake.inits
    assert (init["project"], init["name"], init["id"], init["resume"]) == (
        "p",
        "n",
        "abc123",
        "allow",
    )
    assert fake.logged[0][0] == 3 and fake.logged[0][1]["loss"] == 2.0


def test_wandb_run_id_is_configured_or_kept_or_new():
    assert wandb_run_id("mine", {"wandb_runid": "old"}) == "mine"
    assert wandb_run_id("", {"wandb_runid": "old"}) == "old"
    new = {wandb_run_id("", None), wandb_run_id("", {"wandb_runid": ""})}
    assert len(new) == 2 and all(len(i) == 16 and int(i, 16) >= 0 for i in new)


def test_jax_array_values(tmp_path, clock):
    logger = MetricsLogger(str(tmp_path), total_steps=10, log_every=5, progress_bar=False)
    logged = [r for r in _run_ten_steps(logger, clock, as_jax=True) if r is not None]
    out = logger.log_step(11, {"loss": jnp.float32(1.5)}, samples=jnp.int32(3), force=True)
    logger.close()
    assert [r["loss"] for r in logged] == pytest.approx([3.0, 8.0])
    assert [r["lr"] for r in logged] == pytest.approx([0.3, 0.8])
    assert isinstance(logged[0]["loss"], float)
    assert out["loss"] == 1.5 and out["perf/samples_per_sec"] > 0
    assert _accumulator(tmp_path).Scalars("lr")[1].value == pytest.approx(0.8)


def test_log_text_and_config(tmp_path, clock, capsys):
    logger = MetricsLogger(
        str(tmp_path), total_steps=10, log_every=5, progress_bar=False, config={"lr": 1e-5}
    )
    logger.log_text(3, "completion", "The answer is 42.")
    logger.close()
    logger.close()  # idempotent
    assert "The answer is 42." in capsys.readouterr().out
    rows = _read_jsonl(tmp_path / "text.jsonl")
    assert rows[0]["step"] == 3 and rows[0]["text"] == "The answer is 42."
    acc = _accumulator(tmp_path)
    events = acc.Tensors("completion/text_summary")
    assert events[0].step == 3
    assert events[0].tensor_proto.string_val == [b"The answer is 42."]
    assert json.loads(acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0]) == {
        "lr": 1e-5
    }


def _log_four_steps_and_a_completion(clock):
    logger = MetricsLogger(None, total_steps=4, log_every=2, progress_bar=True)
    for step in range(1, 5):
        clock.t += 0.5
        logger.log_step(step, {"loss": 0.5})
        if step == 2:
            logger.log_text(step, "completion", "two\nlines")
    logger.close()


def test_progress_bar_on_a_terminal_keeps_lines_on_stdout(clock, capsys, monkeypatch):
    monkeypatch.setattr(metrics, "_is_terminal", lambda stream: True)
    _log_four_steps_and_a_completion(clock)
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 3 and lines[0].startswith("step 2/4 | loss 0.5 |")
    assert lines[1] == "[step 2] completion: two\\nlines"
    assert "4/4" in captured.err and "\r" in captured.err  # the bar itself goes to stderr


def test_no_progress_bar_when_output_is_not_a_terminal(clock, capsys):
    """Redirected to a file (capsys is not a terminal): no bar, no carriage return, one line per
    event, even for a multi-line completion."""
    _log_four_steps_and_a_completion(clock)
    captured = capsys.readouterr()
    assert captured.err == "" and "\r" not in captured.out
    assert captured.out.splitlines() == [
        "step 2/4 | loss 0.5 | 2 steps/s | ETA 1s",
        "[step 2] completion: two\\nlines",
        "step 4/4 | loss 0.5 | 2 steps/s | ETA 0s",
    ]


def test_control_characters_in_text_are_escaped_in_every_sink(tmp_path, clock, capsys):
    text = "red \x1b[31mtext\x1b[0m\x07 nul\x00 del\x7f csi\x9b2J\nnext\tline é"
    logger = MetricsLogger(str(tmp_path), total_steps=10, log_every=5, progress_bar=False)
    logger.log_text(3, "completion", text)
    logger.close()
    controls = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")  # every control but newline
    out = capsys.readouterr().out
    assert out == (
        "[step 3] completion: red \\x1b[31mtext\\x1b[0m\\x07 nul\\x00 del\\x7f "
        "csi\\x9b2J\\nnext\\tline é\n"
    )
    raw = (tmp_path / "text.jsonl").read_text(encoding="utf-8")
    assert not controls.search(raw) and raw.count("\n") == 1
    assert json.loads(raw)["text"] == text  # the exact text, in JSON escapes
    logged = _accumulator(tmp_path).Tensors("completion/text_summary")[0].tensor_proto.string_val[0]
    assert logged.decode() == (
        "red \\x1b[31mtext\\x1b[0m\\x07 nul\\x00 del\\x7f csi\\x9b2J\nnext\tline é"
    )


@pytest.mark.parametrize(
    "value, text",
    [
        (0.0123, "0.0123"),
        (9.8e-6, "9.8e-06"),
        (0.41, "0.41"),
        (1534.2, "1534"),
        (1.23456, "1.235"),
        (3.0, "3"),
        (2.5e7, "2.5e+07"),
        (float("nan"), "nan"),
    ],
)
def test_format_number(value, text):
    assert format_number(value) == text


def test_format_duration():
    assert [format_duration(s) for s in (5, 130, 3 * 3600 + 300)] == ["5s", "2m10s", "3h05m"]


def test_writing_events_imports_no_torch(tmp_path):
    """A run's event file costs no torch import (about 4 s of every train.py start where torch is
    installed, as in this venv): tensorboardX's package imports it; the tensorboard package's
    protos, which EventFile uses, do not. Checked in a fresh process, since this one has
    torch from the parity tests."""
    code = (
        "import sys; from opsd_jax.training.metrics import EventFile; "
        f"f = EventFile({str(tmp_path)!r}); f.add_scalar('loss', 1.0, 1, 0.0); "
        "f.add_text('completion', 'x', 1); f.close(); "
        "print(sorted(m for m in ('torch', 'tensorboardX') if m in sys.modules))"
    )
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", result.stdout
    events = _accumulator(tmp_path)
    assert events.Scalars("loss")[0].value == 1.0
    assert events.Tensors("completion/text_summary")[0].tensor_proto.string_val == [b"x"]

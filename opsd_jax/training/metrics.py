"""Training metrics: console lines, a progress bar, TensorBoard events, a JSONL file and W&B.

The trainer calls `MetricsLogger.log_step` after every optimizer step with that step's scalars
and wraps the parts of a step in `with logger.phase("sample"): ...`. Every `log_every` steps the
logger writes one averaged record to each sink:

* stdout: one compact line (`step 40/200 | loss 0.0123 | ... | 1.23 steps/s | ... | ETA 2m10s`);
* TensorBoard: one scalar per key plus `perf/*` (throughput, ETA) and `time/*` (phase timings);
* `<logdir>/metrics.jsonl`: the same record as one JSON object per line, for plotting scripts;
* Weights & Biases, only when asked for and the package is installed.

Why it is shaped this way:

* Step values are often device scalars still being computed (JAX dispatches asynchronously).
  Converting one to a float blocks until the step finishes, which would serialise the host
  against the device on every step. So raw values are only stored per step, and converted with
  a single `jax.device_get` when a line is due.
* TensorFlow is not a dependency. Events are the tensorboard package's protos and record format
  (scalars as `simple_value`s, text for the text dashboard under `<tag>/text_summary`), which
  `EventAccumulator` and the TensorBoard UI read like any other event file. They are written on
  the caller's thread (`EventFile`), not by `SummaryWriter`'s background thread: a write the
  disk refuses is then an OSError naming the file, raised here (the run ends on it with one
  line), not a traceback from a dead thread whose full queue blocks the next writes, nor a
  second one from its exit hook after the run has ended. Every file's write errors name it.
* Only the main process (`jax.process_index() == 0` by default) logs anything, so multi-host
  runs do not write N copies. Values passed in must then be readable from the main process
  (host numbers or fully replicated/addressable arrays, as a jitted step's scalar outputs are).
* One line per event on the console, and no raw control characters anywhere: a sampled
  completion is model output and may hold ESC, BEL or NUL, which would recolour or garble a
  terminal and a log; its newlines would break the one-line-per-event layout. The console
  shows them escaped (`\\x1b`, `\\n`), TensorBoard keeps the newlines and escapes the rest,
  and `text.jsonl` keeps the exact text in JSON escapes.
* The progress bar redraws itself with carriage returns; in a file that is noise between the
  lines, so it is only drawn when stdout and stderr are both terminals.

One module of about 540 lines: every output of a logged event (console, TensorBoard, JSONL, W&B,
the progress bar) behind one call, with the escaping rules above applied alike to all.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any, Self

import jax
import numpy as np

from opsd_jax.io import disk_errors
from opsd_jax.parallel import distributed

# Interval clock; a module attribute so tests can substitute a deterministic one.
_now = time.perf_counter

# The logged records, one JSON object a line, under the log directory (read back by
# evaluation/run_summary.py for a resumed run's summary, and by scripts/plot_run.py).
METRICS_FILE = "metrics.jsonl"


# C0 controls, DEL and C1 controls (Unicode category Cc): they act on a terminal, not print.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_NAMED_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def escape_controls(text: str, keep: str = "") -> str:
    """`text` with every control character not in `keep` written as a visible escape (`\\n`,
    `\\x1b`, `\\x9b`), so logged model output cannot move the cursor, ring the bell or recolour
    a terminal."""

    def escape(match: re.Match) -> str:
        c = match.group()
        return c if c in keep else _NAMED_ESCAPES.get(c, f"\\x{ord(c):02x}")

    return _CONTROL.sub(escape, text)


def json_line(record: Mapping[str, Any]) -> str:
    """One JSON object per line, non-ASCII text kept readable; every control character as a JSON
    escape (json.dumps escapes C0 ones itself but writes DEL and C1 raw), so the file holds the
    exact text and no raw control byte."""
    text = json.dumps(record, ensure_ascii=False)
    return _CONTROL.sub(lambda m: f"\\u{ord(m.group()):04x}", text) + "\n"


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _is_latest_value(key: str) -> bool:
    """Cumulative counters (data pipeline stats, running totals) are reported as-is, not averaged:
    the mean of a running count over a window is meaningless."""
    return key.startswith("data/") or key.endswith("_total")


def _is_window_max(key: str) -> bool:
    """A bound (e.g. rollout/staleness_max) is reported as its largest value over the window,
    not its mean: a mean would hide the step that came closest to it."""
    return key.endswith("_max")


def _count_of(key: str) -> str:
    """The count a per-token mean is taken over: `source/<name>/jsd` has `source/<name>/tokens`
    beside it (a key without such a sibling is a plain mean)."""
    return key.rsplit("/", 1)[0] + "/tokens" if "/" in key and not key.endswith("/tokens") else ""


def _token_weighted_mean(values: list, counts: list) -> float:
    """A per-token mean over a window: each step's mean weighed by its tokens. A step without
    tokens (its mean NaN) weighs nothing; a window without any is NaN."""
    total = weight = 0.0
    for value, count in zip(values, counts):
        value, count = _to_float(value), _to_float(count)
        if value is not None and count:
            total, weight = total + value * count, weight + count
    return total / weight if weight else math.nan


def format_number(value: float) -> str:
    """Compact rendering: about 4 significant digits, scientific only for tiny or huge values."""
    if math.isnan(value) or math.isinf(value):
        return str(value)
    if value == 0:
        return "0"
    a = abs(value)
    if a < 1e-3 or a >= 1e6:
        mantissa, exponent = f"{value:.3e}".split("e")
        # Trailing zeros in the mantissa carry no information: 9.800e-06 -> 9.8e-06.
        mantissa = mantissa.rstrip("0").rstrip(".")
        return f"{mantissa}e{exponent}"
    if a >= 1000:
        # Whole numbers read better than 1.534e+03 for throughputs and lengths in this range.
        return f"{value:.0f}"
    return f"{value:.4g}"


def format_duration(seconds: float) -> str:
    """`45s`, `2m10s`, `3h05m` — short enough for a console line."""
    if math.isnan(seconds) or math.isinf(seconds):
        return "?"
    s = round(max(seconds, 0.0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _to_float(value: Any) -> float | None:
    """A host value (after device_get) as a float, or None when it is not numeric."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        # Multi-host: a replicated metric has a full copy here; anything else is not a scalar.
        if not value.is_fully_replicated:
            return None
        value = value.addressable_data(0)
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 - any unconvertible value is simply "not numeric"
        return None
    if arr.dtype.kind not in "biuf":
        return None
    # Scalars are expected; a larger array is summarised by its mean rather than rejected.
    return float(arr) if arr.size == 1 else float(arr.mean())


def wandb_run_id(configured: str, saved_config: Mapping | None) -> str:
    """The W&B run id of a training run, so that a resumed run continues its W&B run.

    `configured` (config `wandb_runid`) wins when set. Otherwise the id recorded in the config of
    the run's own checkpoint (`saved_config`, None on a fresh start), else a new random id:
    process 0's on every process (call this on all of them), so the config every process holds,
    and the checkpoints save, is the same.
    """
    if configured:
        return str(configured)
    if saved_config and saved_config.get("wandb_runid"):
        return str(saved_config["wandb_runid"])
    words = distributed.all_processes(np.frombuffer(os.urandom(8), np.uint32))[0]
    return "".join(f"{int(w):08x}" for w in words)


class EventFile:
    """A TensorBoard event file in `logdir`, named as TensorBoard's writers name theirs, written
    and flushed on the calling thread (why: the module docstring)."""

    def __init__(self, logdir: str):
        # Imported here so that importing this module stays cheap. The tensorboard package's
        # protos and record framing, not tensorboardX's: importing tensorboardX imports torch
        # where it is installed, for tensors we never pass (a tiny train.py start with torch
        # installed: 17.2 s -> 13.2 s).
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.plugins.text import metadata as text_metadata
        from tensorboard.summary.writer.record_writer import RecordWriter
        from tensorboard.util import tensor_util

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self._text_metadata = text_metadata.create_summary_metadata("", "")
        self._string_tensor = tensor_util.make_tensor_proto
        self.path = os.path.join(
            logdir, f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        )
        with disk_errors.naming(self.path):
            self._file = open(self.path, "wb")
        self._records = RecordWriter(self._file)
        self._write(self._event(wall_time=time.time(), file_version="brain.Event:2"))

    def add_scalar(self, tag: str, value: float, step: int, wall_time: float) -> None:
        value = self._summary.Value(tag=tag, simple_value=float(value))
        self._add(self._summary(value=[value]), step, wall_time)

    def add_text(self, tag: str, text: str, step: int) -> None:
        # As TensorBoard's text plugin files a string: `<tag>/text_summary`, a 1-element tensor.
        value = self._summary.Value(
            tag=f"{tag}/text_summary",
            metadata=self._text_metadata,
            tensor=self._string_tensor([text]),
        )
        self._add(self._summary(value=[value]), step, time.time())

    def _add(self, summary, step: int, wall_time: float) -> None:
        self._write(self._event(summary=summary, step=int(step), wall_time=wall_time))

    def _write(self, event) -> None:
        with disk_errors.naming(self.path):
            self._records.write(event.SerializeToString())

    def flush(self) -> None:
        with disk_errors.naming(self.path):  # a full disk says so here, not at the next write
            self._records.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        with disk_errors.naming(self.path):
            self._records.close()


class MetricsLogger:
    """Accumulates per-step scalars and phase timings; writes averaged records every `log_every`
    steps (see the module docstring). All methods are no-ops on non-main processes."""

    def __init__(
        self,
        logdir: str | None,
        *,
        total_steps: int,
        log_every: int,
        start_step: int = 0,
        is_main: bool | None = None,
        progress_bar: bool = True,
        wandb: dict | None = None,
        config: dict | None = None,
        peak_flops: float | None = None,
    ) -> None:
        """`peak_flops`: the devices' dense peak FLOP/s together (step_flops.dense_peak x the
        device count); with it and each step's model FLOPs, the window's MFU is logged."""
        self.logdir = logdir
        self.peak_flops = peak_flops
        self.total_steps = int(total_steps)
        self.log_every = int(log_every)
        self.is_main = (jax.process_index() == 0) if is_main is None else bool(is_main)
        self._closed = False
        self._writer = None
        self._jsonl = None
        self._text_jsonl = None
        self._bar = None
        self._wandb_run = None
        self._warned_non_numeric: set[str] = set()
        self._reset_window()
        self._window_start = _now()
        if not self.is_main:
            return

        if logdir is not None:
            os.makedirs(logdir, exist_ok=True)
            self._writer = EventFile(logdir)
            # Append: a resumed run continues the same files instead of truncating history.
            self._jsonl = open(  # noqa: SIM115 - lives until close()
                os.path.join(logdir, METRICS_FILE), "a", encoding="utf-8"
            )
        if progress_bar and _is_terminal(sys.stdout) and _is_terminal(sys.stderr):
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=self.total_steps, initial=int(start_step), dynamic_ncols=True, unit="step"
            )
        if wandb is not None:
            self._init_wandb(wandb, config)
        if config is not None and self._writer is not None:
            self._writer.add_text("config", json.dumps(config, indent=2), int(start_step))
            self._writer.flush()
        # Construction (file creation, W&B start-up) should not count as training time.
        self._window_start = _now()

    # ------------------------------------------------------------------ setup

    def _init_wandb(self, options: dict, config: dict | None) -> None:
        try:
            import wandb
        except ImportError:
            self._print(
                "WARNING: W&B logging was requested but the `wandb` package is not installed; "
                "continuing without it (pip install wandb to enable)."
            )
            return
        try:
            self._wandb_run = wandb.init(
                project=options.get("project"),
                name=options.get("name"),
                mode=options.get("mode", "offline"),
                dir=options.get("dir"),
                # The same id after a restart continues the same W&B run (see wandb_run_id).
                id=options.get("id"),
                resume=options.get("resume"),
                config=config,
            )
        except Exception as e:  # noqa: BLE001 - logging must not take the training run down
            self._print(f"WARNING: wandb.init failed ({e!r}); continuing without W&B.")

    def _reset_window(self) -> None:
        self._values: dict[str, list[Any]] = {}  # raw per-step values, converted at log time
        self._samples: list[Any] = []
        self._tokens: list[Any] = []
        self._model_flops = 0.0
        self._phase_secs: dict[str, float] = {}
        self._window_steps = 0

    # ------------------------------------------------------------------ public API

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a named part of a step. JAX dispatch is asynchronous: to attribute device time to
        the phase, block on its outputs inside the block. Nested phases each count in full."""
        if not self.is_main:
            yield
            return
        t0 = _now()
        try:
            yield
        finally:
            self._phase_secs[name] = self._phase_secs.get(name, 0.0) + (_now() - t0)

    def log_step(
        self,
        step: int,
        scalars: Mapping[str, Any],
        *,
        samples: int = 0,
        tokens: int = 0,
        model_flops: float = 0.0,
        force: bool = False,
    ) -> dict[str, float] | None:
        """Record one optimizer step; on logging steps write every sink and return the logged
        record (tag -> float), else return None. `model_flops`: the step's analytic model FLOPs
        (opsd_jax/training/step_flops.py), for the MFU."""
        if not self.is_main or self._closed:
            return None
        for key, value in scalars.items():
            if _is_latest_value(key):
                self._values[key] = [value]
            else:
                self._values.setdefault(key, []).append(value)
        self._samples.append(samples)
        self._tokens.append(tokens)
        self._model_flops += float(model_flops)
        self._window_steps += 1
        if self._bar is not None:
            self._bar.update(1)
            loss = scalars.get("loss")
            # Only host numbers here: a device value would force a sync every step.
            if isinstance(loss, (int, float, np.number)):
                self._bar.set_postfix_str(f"loss {format_number(float(loss))}", refresh=False)

        if not self.logs_at(step, force=force):
            return None
        return self._flush_window(int(step))

    def logs_at(self, step: int, *, force: bool = False) -> bool:
        """Whether `log_step(step, force=force)` writes the window: a logging step (every
        log_every), the last step, or forced."""
        due = self.log_every > 0 and step % self.log_every == 0
        return force or due or step >= self.total_steps

    def log_scalars(self, step: int, record: Mapping[str, float]) -> None:
        """Scalars outside a step's window (e.g. the evaluation of the starting weights at step
        0): every sink, no console line."""
        if self.is_main and not self._closed:
            self._write_sinks(int(step), {k: float(v) for k, v in record.items()})

    def log_note(self, step: int, text: str) -> None:
        """A console line about the run (not a metric), e.g. samples the packs had to cut."""
        if self.is_main and not self._closed:
            self._print(f"[step {step}] {text}")

    def log_text(self, step: int, tag: str, text: str) -> None:
        """Record a piece of text (e.g. a sampled completion): TensorBoard text plugin,
        `<logdir>/text.jsonl` and the console."""
        if not self.is_main or self._closed:
            return
        self._print(f"[step {step}] {tag}: {escape_controls(text)}")
        if self._writer is not None:
            self._writer.add_text(tag, escape_controls(text, keep="\n\t"), int(step))
            self._writer.flush()
        if self.logdir is not None:
            if self._text_jsonl is None:
                path = os.path.join(self.logdir, "text.jsonl")
                self._text_jsonl = open(path, "a", encoding="utf-8")  # noqa: SIM115
            record = {"step": int(step), "time": time.time(), "tag": tag, "text": text}
            with disk_errors.naming(self._text_jsonl.name):
                self._text_jsonl.write(json_line(record))
                self._text_jsonl.flush()
        if self._wandb_run is not None:
            self._wandb_run.log({tag: escape_controls(text, keep="\n\t")}, step=int(step))

    def close(self) -> None:
        """Flush and close every sink. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._writer.close()
        for f in (self._jsonl, self._text_jsonl):
            if f is not None:
                with disk_errors.naming(f.name):
                    f.close()
        if self._bar is not None:
            self._bar.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _flush_window(self, step: int) -> dict[str, float]:
        now = _now()
        elapsed = max(now - self._window_start, 1e-12)
        n = max(self._window_steps, 1)
        # One transfer for the whole window instead of one blocking read per value per step.
        host_values, host_samples, host_tokens = jax.device_get(
            (self._values, self._samples, self._tokens)
        )

        record: dict[str, float] = {}
        for key, values in host_values.items():
            floats = [f for f in map(_to_float, values) if f is not None]
            if not floats:
                if key not in self._warned_non_numeric:
                    self._warned_non_numeric.add(key)
                    self._print(f"WARNING: metric {key!r} is not numeric; not logged.")
                continue
            if _is_latest_value(key):
                record[key] = floats[-1]
            elif _is_window_max(key):
                record[key] = max(floats)
            elif _count_of(key) in host_values:
                record[key] = _token_weighted_mean(values, host_values[_count_of(key)])
            else:
                record[key] = sum(floats) / len(floats)

        samples = sum(_to_float(s) or 0.0 for s in host_samples)
        tokens = sum(_to_float(t) or 0.0 for t in host_tokens)
        steps_per_sec = self._window_steps / elapsed
        # ETA from the latest window only: the first window includes compilation, and later
        # windows track the current speed better than a run-long average.
        eta = (elapsed / n) * max(self.total_steps - step, 0)
        record["perf/steps_per_sec"] = steps_per_sec
        record["perf/samples_per_sec"] = samples / elapsed
        record["perf/tokens_per_sec"] = tokens / elapsed
        if self.peak_flops and self._model_flops:
            # MaxText's MFU over the window's wall time: the rollout, packing and evaluation
            # count as time, not as FLOPs (a step's end-to-end efficiency on these devices).
            record["perf/mfu"] = self._model_flops / elapsed / self.peak_flops
        record["perf/eta_sec"] = eta
        phase_total = sum(self._phase_secs.values())
        for name, secs in self._phase_secs.items():
            record[f"time/{name}_sec"] = secs / n
            record[f"time/{name}_fraction"] = secs / phase_total if phase_total > 0 else 0.0

        self._print(self._console_line(step, record, samples > 0, tokens > 0))
        if self._bar is not None and "loss" in record:
            self._bar.set_postfix_str(f"loss {format_number(record['loss'])}")
        self._write_sinks(step, record)

        self._reset_window()
        # Start the next window after the writes, so logging cost is not billed to training.
        self._window_start = _now()
        return record

    def _console_line(
        self, step: int, record: dict[str, float], show_samples: bool, show_tokens: bool
    ) -> str:
        parts = [f"step {step}/{self.total_steps}"]
        # Namespaced extras (perf/, time/, data/ counters, ...) stay in TB/JSONL to keep the
        # line readable; plain keys are the headline numbers the trainer chose to report.
        parts += [f"{k} {format_number(v)}" for k, v in record.items() if "/" not in k]
        # With a teacher per data source, each source's distillation (source/<name>/jsd, or
        # offline source/<name>/kd).
        for term in ("jsd", "kd"):
            by_source = [
                f"{k[len('source/') : -len(term) - 1]} {format_number(v)}"
                for k, v in record.items()
                if k.startswith("source/") and k.endswith(f"/{term}")
            ]
            if by_source:
                parts.append(f"{term} by source " + " ".join(by_source))
        parts.append(f"{format_number(record['perf/steps_per_sec'])} steps/s")
        if show_samples:
            parts.append(f"{format_number(record['perf/samples_per_sec'])} samples/s")
        if show_tokens:
            parts.append(f"{format_number(record['perf/tokens_per_sec'])} tok/s")
        if "perf/mfu" in record:
            parts.append(f"MFU {100 * record['perf/mfu']:.1f}%")
        phases = [
            f"{k[len('time/') : -len('_fraction')]} {round(100 * v)}%"
            for k, v in record.items()
            if k.startswith("time/") and k.endswith("_fraction")
        ]
        if phases:
            parts.append(" ".join(phases))
        parts.append(f"ETA {format_duration(record['perf/eta_sec'])}")
        return " | ".join(parts)

    def _print(self, line: str) -> None:
        if self._bar is not None:
            # Printing around an active bar would leave half-drawn bars in the scrollback.
            self._bar.write(line, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def _write_sinks(self, step: int, record: dict[str, float]) -> None:
        """TensorBoard, metrics.jsonl and W&B."""
        self._write_scalars(step, record)
        if self._jsonl is not None:
            line = {"step": step, "time": time.time(), **record}
            with disk_errors.naming(self._jsonl.name):
                self._jsonl.write(json.dumps(line) + "\n")
                self._jsonl.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(record, step=step)

    def _write_scalars(self, step: int, record: dict[str, float]) -> None:
        if self._writer is None:
            return
        wall_time = time.time()
        for key, value in record.items():
            self._writer.add_scalar(key, value, step, wall_time)
        # Flushing once per logged line is cheap and keeps TensorBoard live during training.
        self._writer.flush()

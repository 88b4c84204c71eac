"""Plot training curves of one or several runs against the step, as PNG files.

    python scripts/plot_run.py results/tiny [results/sanity ...] [--out plots] [--keys loss,jsd]
        [--labels a,b] [--smooth 0.6]

A run is a trainer results_dir. Its scalars are read from the TensorBoard event files there
(`EventAccumulator`, every event kept), or, when it has none, from `metrics.jsonl` (both are
written by opsd_jax/training/metrics.py with the same keys). A step logged twice (a resumed run appends
to the same files) keeps its last value.

Default keys: loss, jsd, ce, completion_length, lr, eval/accuracy; the plot of eval/accuracy
also draws every per-dataset `eval/<dataset>/accuracy` line found. Keys absent from every run
are reported and skipped. Output: `<out>/<key>.png` per key ('/' -> '_') and `<out>/overview.png`
with all of them in one grid.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

import numpy as np

DEFAULT_KEYS = ("loss", "jsd", "ce", "completion_length", "lr", "eval/accuracy")
EVAL_ACCURACY = "eval/accuracy"

Series = dict[str, tuple[np.ndarray, np.ndarray]]  # key -> (steps, values), sorted by step


def _dedupe(points: list[tuple[int, float]]) -> tuple[np.ndarray, np.ndarray]:
    last = {}
    for step, value in points:  # in file order: a re-logged step keeps its latest value
        last[int(step)] = float(value)
    steps = np.array(sorted(last), np.int64)
    return steps, np.array([last[s] for s in steps], np.float64)


def read_events(run_dir: str) -> Series:
    """Every scalar of the TensorBoard event files in `run_dir` (empty if there are none)."""
    if not glob.glob(os.path.join(run_dir, "events.out.tfevents.*")):
        return {}
    from tensorboard.backend.event_processing.event_accumulator import (
        SCALARS,
        EventAccumulator,
    )

    accumulator = EventAccumulator(run_dir, size_guidance={SCALARS: 0})  # 0 = keep every event
    accumulator.Reload()
    return {
        tag: _dedupe([(e.step, e.value) for e in accumulator.Scalars(tag)])
        for tag in accumulator.Tags()[SCALARS]
    }


def read_jsonl(run_dir: str) -> Series:
    """Every numeric key of `run_dir/metrics.jsonl` (empty if the file is missing)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return {}
    points: dict[str, list[tuple[int, float]]] = {}
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                # A run killed mid-write leaves a partial last line; the rest is still good.
                print(f"warning: {path}:{line_no} is not JSON; skipped", file=sys.stderr)
                continue
            if "step" not in record:
                continue
            for key, value in record.items():
                if key not in ("step", "time") and isinstance(value, (int, float)):
                    points.setdefault(key, []).append((record["step"], value))
    return {key: _dedupe(p) for key, p in points.items()}


def read_run(run_dir: str) -> Series:
    """A run's scalars: TensorBoard events, else metrics.jsonl."""
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"run directory {run_dir!r} does not exist")
    series = read_events(run_dir) or read_jsonl(run_dir)
    if not series:
        raise FileNotFoundError(
            f"{run_dir}: no TensorBoard events and no metrics.jsonl with "
            "scalars (is it a trainer results_dir?)"
        )
    return series


def smooth(values: np.ndarray, weight: float) -> np.ndarray:
    """TensorBoard-style exponential moving average (weight 0 = none), debiased at the start."""
    if weight <= 0 or values.size == 0:
        return values
    out, average, norm = np.empty_like(values), 0.0, 0.0
    for i, value in enumerate(values):
        average = weight * average + (1 - weight) * value
        norm = weight * norm + (1 - weight)
        out[i] = average / norm
    return out


def _lines_for(key: str, series: Series) -> list[str]:
    if key != EVAL_ACCURACY:
        return [key] if key in series else []
    per_dataset = sorted(
        k
        for k in series
        if k.startswith("eval/") and k.endswith("/accuracy") and k != EVAL_ACCURACY
    )
    return ([key] if key in series else []) + per_dataset


# Line styles of the per-dataset eval lines of one run (its colour stays the run's).
_DATASET_STYLES = ("--", ":", "-.", (0, (5, 1, 1, 1)))


def _scale_and_limits(axis, plotted: list[np.ndarray]) -> str:
    """Log y where the plotted lines differ by orders of magnitude (CE ~ 6 beside JSD ~ 0.005
    would draw the JSD as a flat line at 0); fixed limits around a constant series (matplotlib
    would zoom into rounding noise). Returns the scale used."""
    values = [v[np.isfinite(v)] for v in plotted if v.size]
    values = [v for v in values if v.size]
    if not values:
        return "linear"
    everything = np.concatenate(values)
    low, high = float(everything.min()), float(everything.max())
    if low == high:
        pad = 0.1 * abs(low) if low else 1.0
        axis.set_ylim(low - pad, high + pad)
        return "linear"
    typical = [float(np.median(np.abs(v[v != 0]))) for v in values if np.any(v != 0)]
    if len(typical) > 1 and max(typical) / min(typical) >= 100:
        if low > 0:
            axis.set_yscale("log")
            return "log"
        axis.set_yscale("symlog", linthresh=min(typical) / 10)
        return "symlog"
    return "linear"


def _draw(
    axis, key: str, runs: dict[str, Series], smoothing: float, colors: dict[str, str] | None = None
) -> bool:
    """One panel: every run's line(s) for `key`, each run in its own colour (`colors`, the same
    in every panel)."""
    drawn, plotted = False, []
    for index, (label, series) in enumerate(runs.items()):
        color = (colors or {}).get(label, f"C{index % 10}")
        datasets = [t for t in _lines_for(key, series) if t != key]
        for tag in _lines_for(key, series):
            steps, values = series[tag]
            name = label if tag == key else f"{label}: {tag.split('/')[1]}"
            style = (
                "-" if tag == key else _DATASET_STYLES[datasets.index(tag) % len(_DATASET_STYLES)]
            )
            if values.size and np.all(values == values[0]):
                name += f" (constant {values[0]:g})"
            if smoothing > 0 and key != "lr" and not key.startswith("eval/"):
                axis.plot(steps, values, linestyle=style, color=color, alpha=0.25)
                axis.plot(
                    steps, smooth(values, smoothing), linestyle=style, color=color, label=name
                )
            else:
                axis.plot(
                    steps,
                    values,
                    linestyle=style,
                    color=color,
                    marker="." if len(steps) < 30 else None,
                    label=name,
                )
            plotted.append(values)
            drawn = True
    scale = _scale_and_limits(axis, plotted)
    axis.set_title(key + ("" if scale == "linear" else f" ({scale} scale)"))
    axis.set_xlabel("step")
    axis.grid(alpha=0.3)
    if drawn:
        axis.legend(fontsize="small")
    return drawn


def plot_runs(
    run_dirs: list[str], out_dir: str, keys=DEFAULT_KEYS, labels=None, smoothing: float = 0.0
) -> dict[str, str]:
    """Write `<out_dir>/<key>.png` per key found and `overview.png`; returns {key: path}."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    if labels is None:
        labels = [os.path.basename(os.path.normpath(d)) or d for d in run_dirs]
    if len(labels) != len(run_dirs):
        raise ValueError(f"--labels has {len(labels)} names for {len(run_dirs)} runs")
    if len(set(labels)) != len(labels):  # two runs named 'run' in different folders
        labels = [os.path.normpath(d) for d in run_dirs]
    runs = {label: read_run(d) for label, d in zip(labels, run_dirs)}
    colors = {label: f"C{i % 10}" for i, label in enumerate(runs)}  # one per run, every panel
    present = [k for k in keys if any(_lines_for(k, s) for s in runs.values())]
    missing = [k for k in keys if k not in present]
    if missing:
        print(f"not in any run (skipped): {', '.join(missing)}")
    if not present:
        available = sorted({k for s in runs.values() for k in s})
        raise ValueError(f"none of the keys {list(keys)} is in the runs; available: {available}")
    os.makedirs(out_dir, exist_ok=True)
    written = {}
    for key in present:
        figure, axis = plt.subplots(figsize=(6.5, 4))
        _draw(axis, key, runs, smoothing, colors)
        figure.tight_layout()
        path = os.path.join(out_dir, key.replace("/", "_") + ".png")
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written[key] = path
    columns = min(3, len(present))
    rows = math.ceil(len(present) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 3.6 * rows), squeeze=False)
    for axis, key in zip(axes.flat, present):
        _draw(axis, key, runs, smoothing, colors)
    for axis in list(axes.flat)[len(present) :]:
        axis.set_visible(False)
    figure.tight_layout()
    written["overview"] = os.path.join(out_dir, "overview.png")
    figure.savefig(written["overview"], dpi=90)
    plt.close(figure)
    return written


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="results_dir of each run")
    parser.add_argument("--out", default=None, help="output folder (default: <first run>/plots)")
    parser.add_argument("--keys", default=",".join(DEFAULT_KEYS), help="comma list of scalars")
    parser.add_argument("--labels", default=None, help="comma list, one name per run")
    parser.add_argument(
        "--smooth", type=float, default=0.0, help="EMA weight in [0, 1) for the curves (0 = raw)"
    )
    args = parser.parse_args(argv)
    if not 0 <= args.smooth < 1:
        raise SystemExit(f"--smooth must be in [0, 1), got {args.smooth}")
    keys = [k for k in args.keys.split(",") if k]
    labels = args.labels.split(",") if args.labels else None
    out = args.out or os.path.join(args.runs[0], "plots")
    try:
        written = plot_runs(args.runs, out, keys, labels, args.smooth)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    for key, path in written.items():
        print(f"{key}: {path}")


if __name__ == "__main__":
    main()

"""scripts/plot_run.py on synthetic runs written by the trainer's MetricsLogger."""

import json
import shutil

import numpy as np
import pytest

from opsd_jax.training.metrics import MetricsLogger
from scripts import plot_run


def write_run(run_dir, steps=6, offset=0.0, with_eval=True):
    """A run as the trainer writes it: TensorBoard events + metrics.jsonl; returns what was logged."""
    logged = {}
    with MetricsLogger(
        str(run_dir), total_steps=steps, log_every=1, progress_bar=False, is_main=True
    ) as logger:
        for step in range(1, steps + 1):
            scalars = {
                "loss": 1.0 / step + offset,
                "jsd": 0.5 / step,
                "lr": 1e-4 * step,
                "completion_length": 10.0 + step,
            }
            if with_eval and step % 2 == 0:
                scalars.update({"eval/accuracy": 0.1 * step, "eval/toy_maze/accuracy": 0.05 * step})
            logger.log_step(step, scalars)
            for key, value in scalars.items():
                logged.setdefault(key, []).append((step, value))
    return logged


def is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_events_and_jsonl_read_back_what_was_logged(tmp_path):
    logged = write_run(tmp_path / "run")
    for series in (
        plot_run.read_events(str(tmp_path / "run")),
        plot_run.read_jsonl(str(tmp_path / "run")),
    ):
        for key in ("loss", "jsd", "lr", "completion_length", "eval/accuracy"):
            steps, values = series[key]
            assert steps.tolist() == [s for s, _ in logged[key]]
            np.testing.assert_allclose(values, [v for _, v in logged[key]], rtol=1e-6)
    # A resumed run appends a step again: the later value wins.
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 6, "loss": 42.0}) + "\n" + '{"step": 7, "lo')  # torn line
    steps, values = plot_run.read_jsonl(str(tmp_path / "run"))["loss"]
    assert steps.tolist() == [1, 2, 3, 4, 5, 6] and values[-1] == 42.0


def test_plots_are_written_for_several_runs(tmp_path):
    write_run(tmp_path / "a")
    write_run(tmp_path / "b", offset=0.3, with_eval=False)
    # A run with metrics.jsonl only (no event files) is read through the fallback.
    (tmp_path / "c").mkdir()
    shutil.copy(tmp_path / "a" / "metrics.jsonl", tmp_path / "c" / "metrics.jsonl")
    runs = [str(tmp_path / name) for name in ("a", "b", "c")]
    written = plot_run.plot_runs(runs, str(tmp_path / "plots"), smoothing=0.5)
    assert set(written) == {"loss", "jsd", "completion_length", "lr", "eval/accuracy", "overview"}
    assert written["eval/accuracy"].endswith("eval_accuracy.png")
    import matplotlib.image

    for path in written.values():
        assert is_png(path)
        pixels = matplotlib.image.imread(path)
        assert pixels.std() > 0.01  # something was drawn, not a blank canvas


def test_cli_and_errors(tmp_path, capsys):
    write_run(tmp_path / "run", with_eval=False)
    plot_run.main([str(tmp_path / "run"), "--keys", "loss,ce", "--labels", "mine"])
    out = capsys.readouterr().out
    assert "not in any run (skipped): ce" in out
    assert is_png(tmp_path / "run" / "plots" / "loss.png")
    assert not (tmp_path / "run" / "plots" / "ce.png").exists()
    with pytest.raises(SystemExit, match="none of the keys"):
        plot_run.main([str(tmp_path / "run"), "--keys", "nothing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no TensorBoard events and no metrics.jsonl"):
        plot_run.main([str(tmp_path / "empty")])
    with pytest.raises(SystemExit, match="does not exist"):
        plot_run.main([str(tmp_path / "missing")])


def _panel(key, runs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots()
    colors = {label: f"C{i}" for i, label in enumerate(runs)}
    plot_run._draw(axis, key, runs, 0.0, colors)
    return figure, axis


def test_one_colour_per_run_in_every_panel_and_log_scale_across_magnitudes():
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    steps = np.arange(1, 11)
    runs = {
        "opsd": {
            "loss": (steps, 0.005 + 0.001 / steps),
            "eval/accuracy": (steps, 0.3 + steps / 50),
            "eval/toy_maze/accuracy": (steps, 0.2 + steps / 50),
        },
        "sft": {
            "loss": (steps, 6.0 + 1.0 / steps),
            "eval/accuracy": (steps, 0.4 + steps / 50),
            "eval/toy_maze/accuracy": (steps, 0.5 + steps / 50),
        },
    }
    for key in ("loss", "eval/accuracy"):
        figure, axis = _panel(key, runs)
        by_run = {}
        for line in axis.get_lines():
            by_run.setdefault(line.get_label().split(":")[0], set()).add(to_hex(line.get_color()))
        assert by_run == {"opsd": {to_hex("C0")}, "sft": {to_hex("C1")}}, by_run
        # A JSD of 0.005 beside a CE of 6 would be a flat line at 0 on a linear axis.
        assert axis.get_yscale() == ("log" if key == "loss" else "linear")
        plt.close(figure)


def test_a_constant_series_gets_sane_limits_and_says_so():
    import matplotlib.pyplot as plt

    steps = np.arange(1, 6)
    figure, axis = _panel("ce", {"opsd": {"ce": (steps, np.zeros(5))}})
    assert axis.get_ylim() == (-1.0, 1.0)
    assert axis.get_lines()[0].get_label() == "opsd (constant 0)"
    plt.close(figure)
    figure, axis = _panel("lr", {"a": {"lr": (steps, np.full(5, 1e-4))}})
    low, high = axis.get_ylim()
    assert low == pytest.approx(0.9e-4) and high == pytest.approx(1.1e-4)
    plt.close(figure)

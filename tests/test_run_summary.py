"""The end-of-run summary: the accuracy table, the change of the no-VT accuracy, the plot."""

import json
import warnings

from opsd_jax.evaluation.evaluate import EvalResult, save_results, summarize
from opsd_jax.evaluation.run_summary import EVAL_DIR, RunSummary, eval_name
from opsd_jax.training.metrics import METRICS_FILE


def summary_of(accuracies: dict[int, tuple[float, float | None]]) -> RunSummary:
    summary = RunSummary()
    for step, (student, teacher) in accuracies.items():
        records = [
            {"correct": False, "reference": "red", "generation": f"wrong at {step}"},
            {"correct": True, "reference": "blue", "generation": f"right at {step}"},
        ]
        summary.add_eval(
            step, "student", {"overall": {"accuracy": student, "num_samples": 8}}, records
        )
        if teacher is not None:
            summary.add_eval(
                step, "teacher", {"overall": {"accuracy": teacher, "num_samples": 8}}, []
            )
    return summary


def test_table_rows_change_and_example():
    lines = summary_of({0: (0.25, 1.0), 10: (0.625, None), 20: (0.5, 0.875)}).lines(chance=0.25)
    assert lines[0] == "held-out accuracy (8 samples, greedy, chance 25%):"
    assert lines[1] == "  step | no VT (student) | with VT (teacher context)"
    assert lines[2] == "     0 |           25.0% |                    100.0%"
    assert lines[3] == "    10 |           62.5% |                         -"
    assert lines[4] == "    20 |           50.0% |                     87.5%"
    # The change is first -> last, with the best named (a peak is not the result).
    assert lines[5] == (
        "  no VT: 25.0% at step 0 -> 50.0% at step 20 (+25.0 points; best 62.5% at step 10)"
    )
    # The example is from the latest evaluation, a right answer where there is one.
    assert lines[6] == (
        "  a held-out answer without VT (step 20, right; reference 'blue'): 'right at 20'"
    )


def test_no_evaluation_no_table_and_a_single_one_has_no_change():
    assert RunSummary().lines() == []
    lines = summary_of({5: (0.5, None)}).lines()
    assert lines[0] == "held-out accuracy (8 samples, greedy):"
    assert not any("no VT:" in line for line in lines)


def test_the_loss_equal_to_one_term_is_drawn_once(tmp_path):
    summary = summary_of({0: (0.25, 1.0), 4: (0.5, 1.0)})
    for step, value in ((2, 0.05), (4, 0.04)):
        summary.add_logged(step, {"loss": value, "jsd": value, "grad_norm": 1.0})
    assert summary.loss_lines() == {"jsd (= loss)": [(2, 0.05), (4, 0.04)]}
    summary.add_logged(6, {"loss": 0.5, "jsd": 0.03, "ce": 0.47})  # loss = CE + JSD now
    assert set(summary.loss_lines()) == {"loss", "jsd", "ce"}
    path = tmp_path / "summary.png"
    summary.plot(str(path), "a run", chance=0.25)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def write_eval(results_dir, step, accuracy, answer="", context="student"):
    """One evaluation's files, as train.py writes them (evaluate.save_results)."""
    records = [
        {
            "dataset": "toy",
            "reference": "red",
            "generation": answer or f"at {step}",
            "correct": i < accuracy * 4,
            "completion_length": 3,
            "finished": True,
            "has_answer_tag": True,
        }
        for i in range(4)
    ]
    result = EvalResult(records=records, summary=summarize(records))
    save_results(result, results_dir / EVAL_DIR, name=eval_name(step, context))


def test_a_resumed_run_summary_starts_at_the_run_first_evaluation(tmp_path):
    """The files of the launches before a resume at step 4: evaluations at 0, 2 and 6 (6 by
    the interrupted launch, past its last checkpoint: the resumed run trains and evaluates it
    again), losses logged at 2, 4 and 6, step 4 twice (an earlier launch, then the one that
    saved step 4: the later counts), the last line cut short by the kill."""
    write_eval(tmp_path, 0, 0.25)
    write_eval(tmp_path, 0, 1.0, context="teacher")
    write_eval(tmp_path, 2, 0.5, answer="the newest")
    write_eval(tmp_path, 6, 1.0)
    logged = [
        {"step": 0, "eval/accuracy": 0.25},
        {"step": 2, "loss": 0.3},
        {"step": 4, "loss": 0.9},
        {"step": 4, "loss": 0.2},
        {"step": 6, "loss": 0.1},
    ]
    lines = [json.dumps(record) for record in logged] + ['{"step": 8, "lo']
    (tmp_path / METRICS_FILE).write_text("\n".join(lines))

    summary = RunSummary()
    summary.add_history(str(tmp_path), up_to_step=4)
    assert summary.evals == {
        0: {"student": (0.25, 4), "teacher": (1.0, 4)},
        2: {"student": (0.5, 4)},
    }
    assert summary.losses == {"loss": [(2, 0.3), (4, 0.2)]}
    assert summary.example_step == 2 and summary.example["generation"] == "the newest"
    assert summary.first_step() == 0
    # The resumed run's own evaluation at 6 follows the history.
    records = [{"correct": True, "reference": "red", "generation": "now"}]
    summary.add_eval(6, "student", {"overall": {"accuracy": 0.75, "num_samples": 4}}, records)
    assert [line.split("|")[0].strip() for line in summary.lines()[2:5]] == ["0", "2", "6"]
    assert "  no VT: 25.0% at step 0 -> 75.0% at step 6 (+50.0 points; best 75.0% at step 6)" in (
        summary.lines()
    )
    fresh = RunSummary()
    fresh.add_history(str(tmp_path / "nothing here"), up_to_step=4)
    assert fresh.evals == {} and fresh.losses == {} and fresh.first_step() is None


def test_a_run_without_evaluations_plots_its_losses_without_a_warning(tmp_path):
    """eval_every=0 and no chance line: the accuracy panel is empty, and matplotlib's 'no
    artists with labels' warning (printed at the end of such a run) is not raised."""
    summary = RunSummary()
    summary.add_logged(2, {"loss": 0.05, "jsd": 0.05})
    path = tmp_path / "summary.png"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        summary.plot(str(path), "a run without evaluations")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

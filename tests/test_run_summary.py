"""The end-of-run summary: the accuracy table, the change of the no-VT accuracy, the plot."""

from opsd_jax.evaluation.run_summary import RunSummary


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

"""scripts/toy_experiment.py's --out holds one mode and seed: a full run after a --quick one
there (which used to reuse the quick data, 48 rows for 4096, and resume the quick checkpoints)
is refused in one line before anything is written or trained. Fast: the data writer and
train.py are replaced by stand-ins that stop the run where it would start its work."""

from __future__ import annotations

import json

import pytest

from scripts import toy_experiment


class Started(Exception):
    """Raised in place of writing the data or launching a stage: the checks let the run in."""


@pytest.fixture
def no_work(monkeypatch):
    def start(*args, **kwargs):
        raise Started

    monkeypatch.setattr(toy_experiment.toy_data, "write_toy_data", start)
    monkeypatch.setattr(toy_experiment, "TrainRun", start)


def test_a_full_run_in_a_quick_runs_out_is_refused(tmp_path, no_work):
    with pytest.raises(Started):
        toy_experiment.main(["--quick", "--out", str(tmp_path)])
    record = json.loads((tmp_path / toy_experiment.RUN_RECORD).read_text())
    assert record["quick"] is True and record["seed"] == 0 and record["num_train"] == 48
    with pytest.raises(
        SystemExit,
        match=r"^error: --out .* holds a --quick run of seed 0 \(its toy_experiment.json\), "
        r"this is a full run of seed 0: pass the --quick and --seed it was made with, "
        r"or another --out$",
    ):
        toy_experiment.main(["--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="this is a --quick run of seed 1"):
        toy_experiment.main(["--quick", "--seed", "1", "--out", str(tmp_path)])
    with pytest.raises(Started):  # the same mode and seed again: resumes, as before
        toy_experiment.main(["--quick", "--out", str(tmp_path)])


def test_a_run_without_a_record_is_not_reused(tmp_path, no_work):
    """An --out an older version wrote (stages, no record): its mode is unknown."""
    (tmp_path / "sft" / "toy" / "data").mkdir(parents=True)
    with pytest.raises(SystemExit, match="holds a run of unknown mode and seed"):
        toy_experiment.main(["--out", str(tmp_path)])
    assert not (tmp_path / toy_experiment.RUN_RECORD).exists()


def test_quick_and_full_runs_have_their_own_default_out(tmp_path, monkeypatch, no_work):
    monkeypatch.setattr(toy_experiment, "ROOT", str(tmp_path))
    for argv in (["--quick"], []):
        with pytest.raises(Started):
            toy_experiment.main(argv)
    made = sorted(p.name for p in (tmp_path / "results" / "toy_experiment").iterdir())
    assert made == ["seed0", "seed0_quick"]

"""scripts/crash_drill.py's checks before it deletes --out: a missing --straight, a --straight
inside --out and a --out that is not a previous drill's are refused in one line, with nothing
deleted; a previous drill's output (its marker file) or --overwrite is replaced. No train.py
runs here: the drill itself is tests/test_train_cli.py's."""

from __future__ import annotations

import pytest

from scripts import crash_drill


class Launched(Exception):
    """Raised in place of the drill's first train.py launch: the checks let it through."""


@pytest.fixture
def no_launch(monkeypatch):
    def launch(*args, **kwargs):
        raise Launched

    monkeypatch.setattr(crash_drill, "kill_and_resume", launch)
    monkeypatch.setattr(crash_drill.subprocess, "run", launch)


def reference_run(path, steps=2):
    """The files the drill reads of an uninterrupted run: toy/ and a complete step `steps`."""
    (path / "toy").mkdir(parents=True)
    (path / "checkpoints" / str(steps)).mkdir(parents=True)
    (path / "checkpoints" / str(steps) / crash_drill.COMMIT_MARKER).write_text("")
    return path


def drill(out, straight, *extra):
    return crash_drill.main(
        ["--kills", "1", "--steps", "2", "--straight", str(straight), "--out", str(out), *extra]
    )


def test_a_missing_straight_is_named_before_anything_is_deleted(tmp_path, no_launch):
    (tmp_path / "out" / "precious").mkdir(parents=True)
    with pytest.raises(SystemExit, match=r"^error: --straight .*nope: no such directory$"):
        drill(tmp_path / "out", tmp_path / "nope")
    assert (tmp_path / "out" / "precious").is_dir()


def test_a_straight_run_inside_out_is_refused_and_kept(tmp_path, no_launch):
    straight = reference_run(tmp_path / "out" / "straight")
    with pytest.raises(SystemExit, match="lies inside --out .*which the drill deletes"):
        drill(tmp_path / "out", straight)
    assert (straight / "checkpoints" / "2" / crash_drill.COMMIT_MARKER).exists()
    with pytest.raises(SystemExit, match="--out .* lies inside --straight"):
        drill(tmp_path / "out" / "straight" / "drill", straight)


def test_a_straight_run_without_the_compared_step_is_refused(tmp_path, no_launch):
    straight = reference_run(tmp_path / "ref", steps=3)
    with pytest.raises(SystemExit, match="no complete checkpoint of step 2"):
        drill(tmp_path / "out", straight)


def test_an_out_that_is_not_a_drills_needs_overwrite(tmp_path, no_launch):
    straight = reference_run(tmp_path / "ref")
    out = tmp_path / "mine"
    (out / "keep").mkdir(parents=True)
    with pytest.raises(SystemExit, match=r"not a crash drill's output \(keep\).*--overwrite"):
        drill(out, straight)
    assert (out / "keep").is_dir()
    with pytest.raises(Launched):
        drill(out, straight, "--overwrite")
    assert not (out / "keep").exists() and (out / crash_drill.DRILL_MARKER).exists()


def test_a_previous_drills_output_is_replaced(tmp_path, no_launch):
    straight = reference_run(tmp_path / "ref")
    out = tmp_path / "drill"
    with pytest.raises(Launched):  # a fresh --out: the drill marks it as its own
        drill(out, straight)
    assert sorted(p.name for p in out.iterdir()) == [crash_drill.DRILL_MARKER, "killed"]
    (out / "killed" / "stale").mkdir()
    with pytest.raises(Launched):  # its own output: replaced without --overwrite
        drill(out, straight)
    assert not (out / "killed" / "stale").exists()
    old_layout = tmp_path / "old"  # a drill's output from before the marker file
    (old_layout / "killed").mkdir(parents=True)
    with pytest.raises(Launched):
        drill(old_layout, straight)

"""scripts/make_toy_data.py checks --tasks and the counts before it writes anything: a typo in
--tasks used to write the tasks before it and then stop with a traceback, a negative
--num_train wrote files of no rows. (Its output is tested in tests/test_data.py.)"""

from __future__ import annotations

import pytest

from scripts import make_toy_data


@pytest.fixture
def no_write(monkeypatch):
    def write(*args, **kwargs):
        raise AssertionError("wrote before the arguments were checked")

    monkeypatch.setattr(make_toy_data, "write_toy_data", write)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--tasks", "toy_maze,toy_cuont"],
            r"^--tasks 'toy_maze,toy_cuont': unknown task\(s\) toy_cuont; known: toy_maze, ",
        ),
        (["--tasks", ","], r"^--tasks ',': no task named; known: toy_maze, "),
        (["--num_train", "-5"], r"^--num_train must be >= 1, got -5$"),
        (["--num_test", "0"], r"^--num_test must be >= 1, got 0$"),
    ],
)
def test_bad_arguments_stop_the_script_before_anything_is_written(
    tmp_path, no_write, flags, message
):
    with pytest.raises(SystemExit, match=message):
        make_toy_data.main(["--out", str(tmp_path / "toy"), *flags])
    assert not (tmp_path / "toy").exists()

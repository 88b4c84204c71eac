"""The units the two test workers share out (tests/conftest.py): a file is run whole by one
worker, the entry-point smoke runs singly, and the longest units start first."""

from conftest import INDEPENDENT_CASES, ROOT, UNIT_SECONDS, unit_seconds, work_unit
from test_entry_points import SMOKE_RUNS


def test_a_files_tests_are_one_unit_and_the_smoke_runs_one_each():
    a, b = "tests/test_offline.py::test_one", "tests/test_offline.py::test_two[x-1]"
    assert work_unit(a) == work_unit(b) == "tests/test_offline.py"
    scale = "tests/test_entry_points.py::test_entry_point_runs[bench/scale.py]"
    check = "tests/test_entry_points.py::test_entry_point_runs[bench/gpu_check.py]"
    assert work_unit(scale) == scale != work_unit(check) == check
    assert unit_seconds(check) == UNIT_SECONDS["bench/gpu_check.py"] > 0
    assert unit_seconds("tests/test_readme.py::test_x") == 0  # a file not timed


def test_every_timed_unit_exists():
    """A renamed file or smoke run must be renamed in UNIT_SECONDS too (else it silently starts
    last again)."""
    files = {path.name for path in (ROOT / "tests").glob("test_*.py")}
    assert set(INDEPENDENT_CASES) <= files
    missing = [unit for unit in UNIT_SECONDS if unit not in files and unit not in SMOKE_RUNS]
    assert not missing, missing

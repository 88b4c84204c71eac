"""The test processes allocate with mimalloc (tests/conftest.py MIMALLOC), with its options
(MIMALLOC_OPTIONS): a lost preload, a package that moved its library, an option mimalloc no
longer reads would leave the suite a tenth or more slower and nothing else would notice."""

import os
import re

from conftest import MIMALLOC, MIMALLOC_OPTIONS, run_python

MAPPED = "import sys; sys.stdout.write(open('/proc/self/maps').read())"

# 100 MB of small objects, then the process's memory backed by transparent huge pages.
HUGE_PAGES = (
    "import re; x = [bytearray(1000) for _ in range(100000)]; "
    "print(re.search(r'AnonHugePages:\\s+(\\d+) kB', open('/proc/self/smaps_rollup').read())[1])"
)


def test_scripts_the_tests_start_run_on_mimalloc():
    assert MIMALLOC and os.path.isfile(MIMALLOC), "cmeel-mimalloc (requirements-test.txt)"
    result = run_python("-c", MAPPED)
    assert result.returncode == 0, result.stderr
    assert MIMALLOC in result.stdout, result.stderr[-2000:]


def test_the_test_workers_run_on_mimalloc():
    """pytest-xdist's workers start after conftest.py set LD_PRELOAD in pytest's own process."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        assert MIMALLOC in open("/proc/self/maps").read()
    else:  # `-n 0`: this process started before conftest.py ran, so only its children have it
        assert MIMALLOC in os.environ["LD_PRELOAD"].split()


def test_mimalloc_reads_the_options_and_takes_no_huge_pages(monkeypatch):
    """mimalloc prints the options it read when MIMALLOC_VERBOSE is set; each of ours must be
    there with our value. And the effect that made them worth setting: small allocations on
    ordinary pages (by default mimalloc asks for huge ones where the kernel's THP mode is
    'madvise', and 100 MB of small objects took 116736 kB of them)."""
    monkeypatch.setenv("MIMALLOC_VERBOSE", "1")
    result = run_python("-c", HUGE_PAGES)
    assert result.returncode == 0, result.stderr[-2000:]
    for option, value in MIMALLOC_OPTIONS.items():
        name = option.removeprefix("MIMALLOC_").lower()
        read = re.search(rf"option '{name}': (-?\d+)", result.stderr)
        assert read, f"mimalloc printed no option {name!r}:\n{result.stderr[-2000:]}"
        assert read[1] == value, (option, read[1])
    assert result.stdout.split()[-1] == "0", f"{result.stdout.split()[-1]} kB of huge pages"

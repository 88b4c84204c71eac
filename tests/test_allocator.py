"""The test processes allocate with mimalloc (tests/conftest.py MIMALLOC): a lost preload, a
package that moved its library, would leave the suite about a tenth slower and nothing else
would notice."""

import os

from conftest import MIMALLOC, run_python

MAPPED = "import sys; sys.stdout.write(open('/proc/self/maps').read())"


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

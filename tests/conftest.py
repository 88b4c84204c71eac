"""Test setup: 8 simulated CPU devices, so mesh and sharding code runs without accelerators.

XLA reads the flag when jax first initialises its backends, so it must be set before jax is
imported anywhere; conftest.py is loaded by pytest before any test module.
"""

import atexit
import os
import re
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import numpy as np


def mimalloc_library() -> str | None:
    """The shared library of the cmeel-mimalloc package (requirements-test.txt), if installed."""
    try:
        files = metadata.files("cmeel-mimalloc") or []
    except metadata.PackageNotFoundError:
        return None
    found = [f.locate() for f in files if re.fullmatch(r"libmimalloc\.so\.\d+", f.name)]
    return str(found[0]) if found else None


# mimalloc as the allocator of every test process and subprocess: XLA's compiles, most of the
# suite's CPU, allocate and free small objects by the million, and glibc's malloc took 15% of a
# CPU compile's time (perf on test_gradient_accumulation_equals_one_big_batch: _int_malloc,
# malloc, _int_free, malloc_consolidate). Preloaded (jax's TPU images preload tcmalloc the same
# way), so it must be in the environment before a process starts: set here, in pytest's own
# process, before pytest-xdist starts its two workers; the workers' train.py and script
# subprocesses inherit it. Measured 2026-12-07, 2 runs each: that test 38.95 / 39.67 s of user
# CPU -> 33.65 / 33.99; a cold train.py smoke run 40.24 / 38.98 -> 34.84 / 36.13 (and a smaller
# peak RSS); the 8-layer GPU decode compile of test_gpu_compile.py 26.4 / 26.0 -> 22.6 / 24.3.
MIMALLOC = mimalloc_library()
# mimalloc's own options, read from the environment when a process starts. By default it asks
# for transparent huge pages and hands freed pages back to the OS after a second, so the
# kernel zeroed a whole 2 MiB page on each first touch of a small page, again after each purge:
# clear_page_erms under mimalloc's page-fault path was 9.1% of a cold train.py smoke run's CPU
# (perf), and the system time of test_gradient_accumulation_equals_one_big_batch 3.3-3.7 s
# (1.9 s under glibc). Without both: 1.9 s. The whole suite (2026-12-07, the README command,
# per-test CPU self + children): 1824 s -> 1621 s of CPU, 16:14 -> 14:13 wall; the system CPU
# of a run 3m15s -> 2m13s. A test process's peak RSS grows a little (that test: 2.0 GB, 1.9).
MIMALLOC_OPTIONS = {"MIMALLOC_ALLOW_THP": "0", "MIMALLOC_PURGE_DELAY": "-1"}
if MIMALLOC:
    if MIMALLOC not in os.environ.get("LD_PRELOAD", ""):
        os.environ["LD_PRELOAD"] = " ".join(filter(None, [MIMALLOC, os.environ.get("LD_PRELOAD")]))
    for option, value in MIMALLOC_OPTIONS.items():
        os.environ.setdefault(option, value)

# Backend optimisation level 0: the tests are dominated by XLA's CPU compile time, which this
# halves (the tiny train step: 10.6 s -> 5.5 s); results stay IEEE-exact, programs run slower.
# The whole suite without it (2026-12-06, 2 cores): 40m31s of user CPU and 21:10 against 28m30s
# to 33m54s and 15:07 to 19:11 with it, although a warm train.py smoke run's 12 steps then take
# 1.30 s instead of 3.78 s: XLA's compiles are 56.7% of the suite's CPU time (jax's monitoring
# events: 1198 s of backend compiles, 231 s of tracing, 140 s of lowering to MLIR).
FAST_COMPILE = "--xla_backend_optimization_level=0"
# Eigen single-threaded in XLA:CPU computations: the suite runs two workers on two cores, each
# with eight simulated devices and train.py subprocesses, so no computation has idle cores to
# spread over; a tiny train.py launch with a warm cache, alone: 11.81 s -> 11.04 s.
SINGLE_THREADED = "--xla_cpu_multi_thread_eigen=false"
# No autotuning in the programs compiled for a GPU without one (tests/test_gpu_compile.py and
# the others that compile for an H100): with no device to time on, XLA's deviceless config
# assigner still compiles every loop fusion to PTX and a cubin to pick its emitter config, and
# what it picks is the empty one. Off, the tiny grad step compiles in 14.0 s instead of 22.8 s
# and its program differs only in those empty backend_config fields: no instruction, fusion,
# buffer or Triton GEMM config changes (test_gpu_compile.py checks it on a small program).
# XLA's kernel cache (--xla_gpu_kernel_cache_file) was tried beside it: the files that compile
# for an H100 took 219 s instead of 227 s, and its reused kernels carry other names, which the
# tests that count a round's kernels by name read (2 of them failed).
NO_DEVICELESS_AUTOTUNE = "--xla_gpu_autotune_level=0"
# ptxas (through nvJitLink) without optimisation in those deviceless compiles: its PTX-to-cubin
# step was 19% of a GPU-compile test's CPU (perf), and nothing the tests read comes after it
# (the optimised HLO, the kernels, the buffers are fixed before the PTX is assembled).
# farm-bench, two tests of test_gpu_compile.py, 3 pairs: 0.92x the CPU time (0.88-1.07x).
UNOPTIMISED_PTXAS = "--xla_gpu_ptx_compiler_extra_flags=-O0"
DEVICES_FLAG = "--xla_force_host_platform_device_count"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" {FAST_COMPILE} {SINGLE_THREADED} {NO_DEVICELESS_AUTOTUNE} {UNOPTIMISED_PTXAS}"
    + f" {DEVICES_FLAG}=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One XLA compilation cache for this test session (JAX's persistent cache), inherited by the
# train.py subprocesses: the tiny step compiles once instead of once per run (~10 s each on
# two cores). A fresh folder per session, so no run depends on what an earlier one left.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="opsd-jax-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)


def pytest_configure(config):
    """In the test processes the cache takes every program, not only those over JAX's
    one-second threshold: the tests build the same small programs again and again (a fresh
    jit per test), and the fast tier took 358.7 s with the threshold, 319.2 s without it. Set
    in this process only, not through the environment, so train.py subprocesses keep their
    own choice (a run of several processes keeps the threshold: opsd_jax/io/compile_cache.py)."""
    del config
    import jax

    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def pytest_collection_finish(session):
    """Each worker's collector as train.py tunes it (train.tune_the_collector), once every test
    module is imported: the tests trace, lower and compile programs as a run does, with torch
    and transformers beside jax in the heap. tests/test_engine.py, test_losses.py and
    test_sampler.py in one process: the collector's CPU time 3.0-3.3 s -> 1.8 s, the whole run
    0.951x the CPU time of the defaults (farm-bench, median of 3 pairs, 0.868-1.003x,
    2026-12-06)."""
    del session
    import train

    train.tune_the_collector()


def subprocess_env(devices: int = 1) -> dict:
    """The environment for a train.py / script subprocess with `devices` CPU devices (the test
    flags other than the device count, and the compilation cache, are kept)."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICES_FLAG)]
    if devices > 1:
        flags.append(f"{DEVICES_FLAG}={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    return env


ROOT = Path(__file__).resolve().parents[1]


def run_python(*argv, devices: int = 1, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python *argv` from the repo root, as a user runs a script (`devices` CPU devices, the
    test session's compile flags and cache), its stdout and stderr captured as text."""
    return subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        env=subprocess_env(devices),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_close_to_scale(
    actual, expected, rel: float, scale: float | None = None, err_msg: str = ""
) -> None:
    """|actual - expected| <= rel * scale everywhere, scale = max |expected| unless given.

    For fp32 results computed in a different order (another mesh, chunk size, code path, or a
    float64 reference): their round-off is proportional to the magnitude of the terms summed,
    not to each result. A pure relative tolerance then fails on small or cancelling results (a
    near-zero gradient entry, the JSD of two nearly equal distributions) that are right to fp32
    precision, so the tolerance here is absolute, in units of the quantity's own scale."""
    expected = np.asarray(expected, np.float64)
    if scale is None:
        scale = float(np.abs(expected).max()) if expected.size else 0.0
    atol = rel * max(scale, float(np.finfo(np.float32).tiny))
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), expected, rtol=0, atol=atol, err_msg=err_msg
    )


def assert_trees_close_to_scale(actual, expected, rel: float) -> None:
    """assert_close_to_scale on every leaf of two pytrees (e.g. gradients), with one scale for
    all: the largest |leaf| of `expected`. A leaf whose values are all ~0 (a gradient that
    barely flows) holds round-off of the size of the others' and would fail a per-leaf scale."""
    import jax

    expected_leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(expected)]
    actual_leaves = jax.tree.leaves(actual)
    assert len(actual_leaves) == len(expected_leaves) > 0
    scale = max(float(np.abs(x).max()) for x in expected_leaves if x.size)
    for i, (a, e) in enumerate(zip(actual_leaves, expected_leaves)):
        assert_close_to_scale(a, e, rel, scale=scale, err_msg=f"leaf {i} of {len(expected_leaves)}")


# Tests whose cases share nothing (no module fixture worth keeping): pytest-xdist may hand each
# case to whichever worker is free, so their minutes even out the two workers' loads.
INDEPENDENT_CASES = ("test_entry_points.py",)

# Files run in one worker with another file, as one unit: they compile the same deviceless
# program, which tests/test_gpu_compile.py keeps per process (JAX's persistent cache does not).
SAME_UNIT_AS = {"test_step_compiler_flags.py": "test_remat.py"}

# The longest units of work (a file, or one case of INDEPENDENT_CASES by its parameter), in
# seconds of one worker on 2 cores (the README command, 2026-12-07: `--durations=0`, summed per
# unit). Only the order of the run depends on them: the longest start first and every unit of
# 9 s or more is named, so what runs last is short and neither worker sits idle long at the end
# (xdist's own order is by the number of tests, which put one-test files such as
# tests/test_remat.py last). A unit not named here weighs 0 and keeps its collection order,
# after these.
UNIT_SECONDS = {
    "test_train_cli.py": 198,
    "test_teacher_by_source.py": 153,
    "test_train_step.py": 100,
    "test_gpu_compile.py": 88,
    "test_preflight.py": 83,
    "test_offline.py": 78,
    "test_lora_training.py": 72,
    "test_multihost.py": 70,
    "test_toy_experiment.py": 50,
    "bench/gpu_check.py": 46,  # 67 before its memory rows' compiles left the dry run
    "test_decode_copy.py": 36,
    "bench/scale.py": 36,
    "test_disk_full.py": 33,
    "test_engine.py": 31,
    "test_qwen2_mot.py": 31,
    "test_teacher_checkpoint.py": 30,
    "test_remat.py": 30,  # with test_step_compiler_flags.py (SAME_UNIT_AS)
    "bench/offline.py": 29,
    "test_sampler.py": 26,
    "test_losses.py": 25,
    "scripts/make_toy_stage1.py": 24,
    "test_layout.py": 23,
    "test_attention.py": 22,
    "test_tiny_demo.py": 20,
    "bench/train_step.py": 20,
    "bench/vs_pytorch.py": 16,
    "test_benchmarks.py": 16,
    "test_evaluation.py": 15,
    "bench/sampler.py": 14,
    "test_step_flops.py": 13,
    "test_decode_attention_pallas.py": 13,
    "test_rollout_mismatch.py": 13,
    "test_sharding.py": 13,
    "test_attention_cudnn.py": 12,
    "test_lora.py": 10,
    "test_bagel.py": 10,
    "bench/grad_step.py": 10,
    "test_pallas_blocks.py": 10,
    "test_attention_pallas.py": 10,
}


def work_unit(nodeid: str) -> str:
    """The unit one worker runs whole: the test's file (so its module-scoped fixtures, compiled
    programs and reference runs, are built once) or the file it shares one with
    (SAME_UNIT_AS), or the test itself in INDEPENDENT_CASES."""
    path = nodeid.split("::", 1)[0]
    name = Path(path).name
    if name in INDEPENDENT_CASES:
        return nodeid
    return str(Path(path).with_name(SAME_UNIT_AS[name])) if name in SAME_UNIT_AS else path


def unit_seconds(nodeid: str) -> float:
    unit = work_unit(nodeid)
    key = unit[unit.find("[") + 1 : -1] if unit.endswith("]") else Path(unit).name
    return UNIT_SECONDS.get(key, 0)


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduler with work_unit as its unit (pyproject.toml runs two workers).
    xdist's own `--dist loadgroup` cannot do it under pytest 9: it renames each test's node id
    to carry the group, and pytest 9 ignores the attribute it sets, so every test became its own
    unit and a file's module fixtures were built on both workers."""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False  # the order is pytest_collection_modifyitems's
    return FileScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """The longest units first (UNIT_SECONDS), each unit's tests in their own order."""
    del config
    position = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-unit_seconds(item.nodeid), position[id(item)]))

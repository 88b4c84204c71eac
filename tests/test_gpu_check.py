"""bench/gpu_check.py's runner and its sections, without a GPU: the order a lease is spent in,
the sections in their own modules, the profile's reduction to kernel classes."""

import ast
import csv
import gzip
import importlib
import json
from pathlib import Path

import pytest
from conftest import ROOT


@pytest.fixture
def bench(monkeypatch):
    """bench/ on the path for this test only, as `python bench/gpu_check.py` has it."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    return importlib.import_module("gpu_check"), importlib.import_module("gpu_sections.profile")


def test_the_real_recipes_step_runs_first_then_the_sweep(bench):
    gpu_check, _ = bench
    assert gpu_check.DEFAULT_SECTIONS[:2] == ("recipe", "grad_step")
    assert "profile" not in gpu_check.DEFAULT_SECTIONS  # only with --profile
    assert "memory" not in gpu_check.DEFAULT_SECTIONS  # only with --memory
    assert set(gpu_check.SECTIONS) == set(gpu_check.ESTIMATE_S)
    # The default run fits the budget by the estimates, so no section is skipped on a GPU
    # that runs as estimated.
    assert sum(gpu_check.ESTIMATE_S[s] for s in ("recipe", "grad_step", "parity")) <= (
        gpu_check.BUDGET_S
    )


def test_every_section_is_its_own_module_and_none_imports_the_runner(bench):
    gpu_check, _ = bench
    folder = ROOT / "bench" / "gpu_sections"
    for name in gpu_check.SECTIONS:
        path = folder / f"{name}.py"
        assert path.is_file(), path
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        } | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "gpu_check" not in imported, path
    assert not (ROOT / "bench" / "gpu_check_train.py").exists()


def test_a_timed_run_holds_no_earlier_runs_output_or_arguments(bench):
    """The allocator's peak that the memory rows set beside a program's prediction must be one
    run's: a run that starts while the last one's output (gradients, a KV cache) is alive shows
    a peak above the program's by that output, which is no shortfall of the prediction."""
    import jax
    import jax.numpy as jnp

    common = importlib.import_module("gpu_sections.common")
    output, donated = (3, 5, 7), (3, 5, 11)  # shapes no other array of the process has
    seen = []

    def alive(shape):
        return sum(a.shape == shape for a in jax.live_arrays())

    def make(**donation):
        step = jax.jit(lambda state: jnp.zeros(output) + state.sum(), **donation)

        def run(state):
            seen.append((alive(output), alive(donated)))
            return step(state)

        return run

    seconds, total = common.timed(
        make(donate_argnums=0),
        repeats=3,
        fresh=lambda: (jnp.ones(donated),),
        read=lambda out: float(out.sum()),
    )
    assert seen == [(0, 1)] * 4  # only this run's own argument; no earlier output
    assert total == 165 * 105 and seconds >= 0
    seen.clear()
    common.timed(make(), jnp.ones(donated), repeats=2)  # the same arguments each run
    assert [s[0] for s in seen] == [0] * 3


def test_the_grad_steps_packs_pad_their_patches_as_a_run_does(bench):
    """The grad step the section times has the 7B recipe's rows, patch axes included: a run's
    pack shapes round patches up to pack_shapes.MULTIPLE, and an axis of 4900 / 8890 patches
    instead makes XLA:GPU pad and slice the ViT's activations around every GEMM of every layer
    (14.5 GiB of the 1-layer step's 170 GiB of HBM traffic, compiled for an H200), which the
    run never pays."""
    import types

    from gpu_sections import grad_step

    from opsd_jax.data import pack_shapes

    _, student, teacher, _ = grad_step.step_case(types.SimpleNamespace(dry_run=False), 1)
    for pack in (student, teacher):
        patches = pack.vit_patches.shape[1]
        real = int((pack.vit_image_ids > 0).sum())  # 0: a padding patch
        assert patches % pack_shapes.MULTIPLE == 0, patches
        assert real <= patches < real + pack_shapes.MULTIPLE, (real, patches)


def write_trace(path: Path, events: list[dict]) -> None:
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
    ]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + events}, f)


def test_the_profile_sums_gpu_time_by_kernel_class(bench, tmp_path):
    _, profile = bench
    kernel = lambda name, us, pid=1: {"ph": "X", "name": name, "pid": pid, "dur": us}  # noqa: E731
    write_trace(
        tmp_path / "t.json.gz",
        [
            kernel("range_attention_forward", 300),
            kernel("range_attention_dkdv", 500),
            kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 700),
            kernel("loop_multiply_fusion_3", 100),
            kernel("ncclDevKernel_AllGather_RING_LL", 50),
            kernel("PjitFunction(step)", 9999, pid=2),  # the host's: not GPU time
        ],
    )
    where, by_class = profile.device_time_by_class(str(tmp_path / "t.json.gz"))
    assert where == "/device:GPU:0"
    assert by_class == {
        "attention forward": (300.0, 1),
        "attention dkdv": (500.0, 1),
        "gemm": (700.0, 1),
        "fusion": (100.0, 1),
        "collective": (50.0, 1),
    }
    profile.write_csv(str(tmp_path / "p.csv"), by_class)
    with open(tmp_path / "p.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["class"] for r in rows][:2] == ["gemm", "attention dkdv"]
    assert rows[0]["ms"] == "0.700" and rows[0]["share"] == f"{700 / 1650:.3f}"

"""train.py --compile_only=TARGET:DEVICES: every program of the run compiled for compile-only
GPUs, each one's peak memory per device against the device's, exit 0 / 1, and nothing read or
written but the config (opsd_jax/run_config/preflight.py)."""

import importlib
import json
import re
import shutil

import pytest
from conftest import ROOT, run_python

from configs import tiny as tiny_config
from opsd_jax import run_config
from opsd_jax.programs import gpu_target
from opsd_jax.run_config import preflight

GIB = 2**30


@pytest.fixture
def program_memory(monkeypatch):
    """bench/program_memory.py, with bench/ on the path for this test only, as
    `python bench/program_memory.py` has it."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    return importlib.import_module("program_memory")


def train(*args, timeout=600):
    return run_python("train.py", *args, timeout=timeout)


@pytest.mark.slow
def test_the_tiny_run_compiles_for_an_h100_and_fits(tmp_path, program_memory):
    """The tiny run with the lookahead, its rollout prefilled 3 prompts at a time, and taught by
    a deeper model of the stage-1 tokenizer (teacher_mode='checkpoint'; its directory needs its
    configs only: nothing else is read)."""
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_config.STAGE1_MODEL, teacher)
    llm = json.loads((teacher / "llm_config.json").read_text())
    llm["num_hidden_layers"] = 3
    (teacher / "llm_config.json").write_text(json.dumps(llm))
    for weights in teacher.glob("*.safetensors"):
        weights.unlink()
    run_dir = tmp_path / "run"
    result = train(
        "--config",
        "configs/tiny.py",
        f"--config.results_dir={run_dir}",
        "--config.rollout_lookahead=1",
        "--config.rollout_prefill_rows=3",  # a group of 4 rows: a power of two, as placed
        "--config.teacher_mode=checkpoint",
        f"--config.teacher_path={teacher}",
        "--compile_only=h100:1",
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert f"preflight: the teacher {teacher}: shapes its llm_config.json" in out, out
    # The lookahead's paused rows keep their KV cache through the train step: counted there.
    assert re.search(r"^rollout_lookahead 1: [\d.]+ GiB per device of paused rows' KV", out, re.M)
    assert "1 compile-only H100 device(s) (79.1 GiB each, 85% of it usable: 67.2 GiB)" in out
    # Every program train.py compiles for the tiny run: its one length bucket's step, the
    # rollout's refresh, then the sampling engine's prefill, insert and decode chunk for the
    # rollout and for the evaluation (the tiny run has no image skip: no next round).
    names = program_memory.predicted_programs(out)  # what bench/program_memory.py measures
    assert [n.split(" (")[0].split(",")[0] for n, _ in names] == [
        "train step",
        "decode-copy refresh",
        *["rollout"] * 3,
        *["evaluation"] * 3,
    ], out
    assert names[2][0].startswith("rollout, 16 rows (prefilled 3 at a time) of "), names
    engine_programs = [n.split(": ", 1)[1] for n, _ in names[2:]]
    # With the lookahead a rollout's prefill can meet paused rows' pool; an evaluation's always
    # can (its prompts outnumber its slots): each is counted beside the pool.
    assert engine_programs == [
        "prefill of 4 rows (beside a pool holding rows)",
        "insert into the pool",
        "decode chunk",
        "prefill (beside a pool holding rows)",
        "insert into the pool",
        "decode chunk",
    ], engine_programs
    assert all(0 < peak < 67.2 for _, peak in names), names
    # 'auto' attention compiled as the GPU runs it (not as this CPU would): the Pallas range
    # kernel in the train step and the prefills, XLA's attention in the decode chunks
    # (attention.DECODE_KERNEL_IN_AUTO).
    kernels = dict(
        re.findall(r"^  (.*?): peak .*; (Pallas kernels: .*|no Pallas kernel)\)$", out, re.M)
    )
    assert len(kernels) == len(names), out
    for name, found in kernels.items():
        if name.startswith("train step"):
            assert found == (
                "Pallas kernels: range_attention_dkdv, range_attention_dq, range_attention_forward"
            ), name
        elif ": prefill" in name:
            assert found == "Pallas kernels: range_attention_forward", name
        else:
            assert found == "no Pallas kernel", name
    assert re.search(r"^fits: every program leaves 15% of a H100 free", out, re.M)
    assert not run_dir.exists()  # no toy data, model, checkpoint or log was written


def test_a_measured_program_runs_alone_on_zeros_with_what_the_preflight_counts_beside_it(
    program_memory,
):
    """`measure=K` (bench/program_memory.py runs it on a GPU): program K alone is lowered and
    compiled for this machine's device and run once on zero arguments, with the bytes the
    preflight counts beside it held there; a CPU has no allocator statistics, so its line has
    XLA's assignment only. A K past the run's programs is named."""
    config = run_config.load_config_file("configs/tiny.py")
    run_config.resolve_paths(config)

    def measured(index):
        lines = []
        assert preflight.run(config, "h100:1", lines.append, measure=index) == 0
        assert not [line for line in lines if line.startswith("  ")], lines  # nothing else
        return json.loads(lines[-1].removeprefix("measured "))

    step = measured(0)  # its arguments are the train state (a PRNG key among them)
    assert step["program"].startswith("train step") and step["index"] == 0
    assert step["assigned"] > 0 and step["beside"] == 0  # no lookahead: nothing beside it
    # As bench/program_memory.py measures each: `--program=K` in a process of its own (with the
    # lookahead, whose rollout inserts into a pool that holds rows).
    done = run_python(
        "bench/program_memory.py",
        *("--config", "configs/tiny.py", "--config.rollout_lookahead=1"),
        *("--target=h100:1", "--program=3"),
    )
    insert = program_memory.measured_line(done)
    assert insert["program"].startswith("rollout") and insert["program"].endswith(
        "insert into the pool"
    )
    assert insert["beside"] > 0  # the train state and the decode copy
    assert "peak" not in insert  # a CPU's allocator reports nothing
    line = program_memory.row(0.5, insert)
    assert line["ratio"] is None and line["figures"].endswith("no allocator statistics"), line
    # On a GPU: the allocator's peak against the prediction, and where the bytes were.
    on_gpu = dict(insert, before=GIB, peak_before_run=GIB, peak=int(0.55 * GIB))
    line = program_memory.row(0.5, on_gpu)
    assert line["ratio"] == pytest.approx(1.1)
    assert line["figures"].startswith("measured 0.55 GiB / predicted 0.50 = 1.10"), line
    with pytest.raises(
        preflight.PreflightError, match="no program 99 to measure: the run compiles 8"
    ):
        preflight.run(config, "h100:1", print, measure=99)


@pytest.mark.parametrize("spec", ["a100:1", ""])
def test_an_unknown_target_is_one_line_before_any_compute(spec, tmp_path):
    # An empty one too (a script's `--compile_only=$TARGET` with TARGET unset): never a real run.
    result = train(
        "--config",
        "configs/tiny.py",
        f"--compile_only={spec}",
        f"--config.results_dir={tmp_path}",
        timeout=120,
    )
    assert result.returncode == 2
    name = spec.partition(":")[0]
    assert result.stderr.strip() == (
        f"train.py: --compile_only={spec}: unknown GPU target {name!r}; known targets: h100, "
        "h200, h800 (as TARGET:DEVICES, e.g. h100:8)"
    )
    assert not any(tmp_path.iterdir())  # nothing written: no lock, no toy data, no checkpoint


@pytest.mark.parametrize(
    "spec, expected",
    [("h100:8", ("h100", 8)), ("H200:1", ("h200", 1)), ("h800", ("h800", 1))],
)
def test_target_specs(spec, expected):
    assert preflight.parse_target(spec) == expected


@pytest.mark.parametrize("spec", ["h100:0", "h100:-1", "h100:x", "tpu:4", ""])
def test_bad_target_specs_are_named(spec):
    with pytest.raises(preflight.PreflightError, match=re.escape(f"--compile_only={spec}")):
        preflight.parse_target(spec)


def test_the_verdict_names_every_program_over_85_percent():
    capacity = gpu_target.memory_bytes("h100")
    assert capacity == 84942979072  # the target config's device_memory_size
    limit = capacity * (1 - preflight.PREFLIGHT_HEADROOM)
    fits = preflight.ProgramMemory("train step", int(limit) - 10, 0, 1.0)
    sampler = preflight.ProgramMemory("rollout: prefill", int(limit) // 4, int(limit) // 4, 1.0)
    code, lines = preflight.verdict([fits, sampler], "h100", capacity)
    assert code == 0 and lines[0].startswith("fits:") and "train step" in lines[0]
    # The resident train state counts: this prefill is small, but not with the state beside it.
    over = preflight.ProgramMemory("rollout: prefill", int(limit) // 2, int(limit) // 2 + 11, 1.0)
    code, lines = preflight.verdict([fits, over], "h100", capacity)
    assert code == 1
    assert lines == [
        f"does not fit: rollout: prefill needs {over.peak / GIB:.2f} GiB per device, more than "
        f"{limit / GIB:.1f} GiB (85% of a H100's 79.1 GiB)",
        "the rollout's prefill: --config.rollout_prefill_rows=N prefills at most N prompts at a "
        "time (each later group beside the pool; docs/configuration.md)",
    ]
    # Only a rollout's prefill gets that setting named.
    step = preflight.ProgramMemory("train step", int(limit) + 1, 0, 1.0)
    code, lines = preflight.verdict([step], "h100", capacity)
    assert code == 1 and len(lines) == 1 and lines[0].startswith("does not fit: train step")


def test_the_usable_share_follows_jax_allocator_fraction(monkeypatch):
    """jax's GPU allocator takes XLA_PYTHON_CLIENT_MEM_FRACTION of the device (75% by default;
    opsd_jax sets 90% unless it is set): the preflight allows no more than the allocator has."""
    import opsd_jax

    variable = opsd_jax.ALLOCATOR_FRACTION_VARIABLE
    assert variable == "XLA_PYTHON_CLIENT_MEM_FRACTION"
    monkeypatch.setenv(variable, "0.90")
    assert preflight.allowed_share() == pytest.approx(1 - preflight.PREFLIGHT_HEADROOM)
    monkeypatch.setenv(variable, "0.6")
    assert preflight.allowed_share() == pytest.approx(0.6)
    capacity = gpu_target.memory_bytes("h100")
    at_80 = preflight.ProgramMemory("train step", int(capacity * 0.8), 0, 1.0)
    code, lines = preflight.verdict([at_80], "h100", capacity)
    assert code == 1 and "60% of a H100" in lines[0], lines
    monkeypatch.delenv(variable)
    assert preflight.allowed_share() == pytest.approx(0.75)  # jax's own default
    monkeypatch.setenv(variable, "most")
    with pytest.raises(preflight.PreflightError, match="XLA_PYTHON_CLIENT_MEM_FRACTION='most'"):
        preflight.allowed_share()


def test_importing_the_package_gives_jax_allocator_90_percent():
    out = run_python(
        "-c",
        "import os; os.environ.pop('XLA_PYTHON_CLIENT_MEM_FRACTION', None); import opsd_jax; "
        "print(os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'])",
    )
    assert out.returncode == 0 and out.stdout.strip() == "0.90", out.stderr

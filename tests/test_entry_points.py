"""Every entry point in bench/ and scripts/ runs, with its smallest settings, as a user runs it.

Why: bench/sampler.py crashed on main for weeks (it decoded the decode copy's state with the
training model's graphdef) and nothing noticed, because no test ran it. Here each entry point
that no other test runs through its `main` is started as its own process (one CPU device, the
test session's compile flags) and must exit 0 and print the line that says it got to its end;
the rest name the test that runs them, and a script added to bench/ or scripts/ without a
smoke run fails `test_every_entry_point_has_a_smoke_run`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ROOT, run_python

# Entry points another test already runs through their main (in-process or as a process): that
# test is their smoke run. The test file must name the script's main or its path.
RUN_ELSEWHERE = {
    "bench/program_memory.py": "tests/test_preflight.py",
    "scripts/collect_traces.py": "tests/test_offline.py",
    "scripts/convert_hf.py": "tests/test_hf.py",
    "scripts/crash_drill.py": "tests/test_train_cli.py",
    "scripts/evaluate.py": "tests/test_evaluation.py",
    "scripts/generate.py": "tests/test_train_cli.py",
    "scripts/make_toy_data.py": "tests/test_data.py",
    "scripts/make_toy_model.py": "tests/test_tokenizer.py",
    "scripts/plot_run.py": "tests/test_plot_run.py",
    "scripts/toy_experiment.py": "tests/test_toy_experiment.py",
}

# The rest: (arguments, a line its output must hold at the end of its work). `{tmp}` is the
# test's own folder, `{toy_data}` a small toy data set (the toy task's held-out split).
SMOKE_RUNS = {
    "bench/attention.py": (
        ["--seq-lens", "256", "--backends", "chunked", "--repeats", "1"],
        r"\n +256 +chunked +\d",
    ),
    "bench/benchmarks.py": (
        ["--rows", "2", "--new-tokens", "4", "--batch-sizes", "1"],
        r"batch +1: +[\d.]+ samples/s",
    ),
    "bench/grad_step.py": (
        ["--steps", "1", "--rows", "1", "--compute-dtype", "float32", "--model", "tiny"],
        r"tiny grad step, 1 device\(s\)",
    ),
    "bench/host_work.py": (["--repeats", "1"], r"host work per step .*total [\d.]+ s"),
    "bench/losses.py": (
        ["--rows", "64", "--vocab", "512", "--top-k", "8", "--skip-full-run"],
        r"top-k temp memory = ",
    ),
    "bench/offline.py": (
        [
            "--steps=1",
            "--warmup=0",
            "--max_new_tokens=8",
            "--tokens_7b=16",
            "--results-dir={tmp}/offline",
        ],
        r"cache, 7B shape: 16 target tokens",
    ),
    "bench/rollout.py": (
        [
            *("--prompts", "6", "--slots", "2", "--cap", "12", "--means", "4"),
            *("--chunk-steps", "4", "--rollout-steps", "3"),
        ],
        r"mean 4 .*: engine \d+ tok/s, static \d+ tok/s, [\d.]+x; .*same completions: True\n"
        r"mean 4 .*training rollout, 3 steps of 2: per step lookahead 0 \d+ ms .*lookahead 1 "
        r"\d+ ms .*same completions: True",
    ),
    "bench/sampler.py": (
        ["--configs", "tiny", "--batch-sizes", "2", "--new-tokens", "4", "--repeats", "1"],
        r"decode tok/s.*\n-+\n +2 +[\d.]+",
    ),
    "bench/scale.py": (
        ["--model", "tiny", "--target", "h100", "--devices", "1", "--skip-host-work", "--skip-fit"],
        r"memory per device on h100 .*\n +fits",
    ),
    "bench/train_step.py": (
        ["--steps", "1", "--warmup", "1", "--results-dir", "{tmp}/train_step"],
        r"new compilations after the 1-step warm-up: 0",
    ),
    "bench/vs_pytorch.py": (
        ["--layers", "2", "--steps", "1", "--rounds", "1"],
        r"ours: m64 \(2 LM layers\)[\s\S]*ours \(best round\): ",
    ),
    # The sections other than the train.py launches (minutes of CPU), then the recipe with a
    # budget that the others' estimates use up, so the run shows that a section is skipped, not
    # started, when the time left is short (a dry run charges each section its estimate, not
    # the CPU's time, so the skip does not depend on this machine's load): the step's sweep at
    # two layer counts, the kernels, the decode round at the checked B = 8 only (B = 1 and 32
    # run the same code), the step under 'full' remat and XLA's flags alone
    # (tests/test_remat.py and test_step_compiler_flags.py compile 'minimal_flash' and the
    # 'maxtext' set). The train section's dry run is left out of CI's budget too:
    # `python bench/gpu_check.py --dry-run --sections recipe train` runs both
    # (bench/gpu_sections/recipe.py, train.py).
    "bench/gpu_check.py": (
        ["--dry-run", "--repeats", "1", "--sweep", "1", "2", "--results-dir", "{tmp}/gpu"]
        + ["--sections", "grad_step", "parity", "decode", "attention", "recipe"]
        + ["--decode-batches", "8", "--budget-s", "600"]
        + ["--remats", "full", "--step-flags", "xla"],
        r"grad_step +fit over 1, 2 layers -> 28 layers"
        r"[\s\S]*parity +decode .* run twice +bit-identical"
        r"[\s\S]*decode +B=8, the output in one sum of the slots"
        r"[\s\S]*attention +T=256 pallas"
        r"[\s\S]*recipe +section +not run: budget"
        r"[\s\S]*rows in \d+ s: .*nothing failed",
    ),
    "scripts/kl_diagnostic.py": (
        [
            "--model_dir",
            "opsd_jax/toy/stage1",
            "--config",
            "configs/tiny.py",
            "--data",
            "toy_majority={toy_data}/toy_majority",
            "--num_samples",
            "4",
            "--batch_size",
            "4",
            "--out",
            "{tmp}/kl",
        ],
        r"verdict: (GO|NO-GO)",
    ),
    "scripts/make_toy_stage1.py": (
        [
            "--steps",
            "2",
            "--eval_samples",
            "8",
            "--work",
            "{tmp}/work",
            "--out",
            "{tmp}/stage1",
        ],
        r"wrote .*stage1 in \d+ s: held-out accuracy",
    ),
}


def entry_points() -> set[str]:
    """The files of bench/ and scripts/ that run as a program."""
    return {
        str(path.relative_to(ROOT))
        for folder in ("bench", "scripts")
        for path in (ROOT / folder).glob("*.py")
        if 'if __name__ == "__main__":' in path.read_text()
    }


def test_every_entry_point_has_a_smoke_run():
    assert not set(SMOKE_RUNS) & set(RUN_ELSEWHERE)
    assert entry_points() == set(SMOKE_RUNS) | set(RUN_ELSEWHERE)
    for script, test_file in RUN_ELSEWHERE.items():
        module = Path(script).stem
        text = (ROOT / test_file).read_text()
        runs_it = re.search(rf"\b{module}(_cli)?\.main\(|[\"']{re.escape(script)}[\"']", text)
        assert runs_it, f"{test_file} no longer runs {script}"


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    from opsd_jax.toy import data as toy_data_lib

    path = tmp_path_factory.mktemp("toy_data")
    toy_data_lib.write_toy_data(
        str(path), seed=0, num_train=16, num_test=16, tasks=["toy_majority"]
    )
    return path


def smoke_cases() -> list:
    """(script, arguments, expected line) per smoke run; a script may have several (a list)."""
    cases = []
    for script, runs in sorted(SMOKE_RUNS.items()):
        runs = runs if isinstance(runs, list) else [runs]
        cases += [
            pytest.param(script, *run, id=script if len(runs) == 1 else f"{script}-{i}")
            for i, run in enumerate(runs)
        ]
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("script, args, expected", smoke_cases())
def test_entry_point_runs(script, args, expected, tmp_path, toy_data):
    args = [a.format(tmp=tmp_path, toy_data=toy_data) for a in args]
    result = run_python(script, *args)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{script} exited {result.returncode}:\n{output[-4000:]}"
    assert re.search(expected, result.stdout), f"{script} printed:\n{result.stdout[-3000:]}"

"""Exact-match accuracy of a BAGEL / ThinkMorph model (or a training checkpoint) on held-out data.

    python scripts/evaluate.py --model_dir D --config configs/tiny.py [--context teacher]
    python scripts/evaluate.py --checkpoint results/tiny [--params ema_params] [--noise_vt]
    python scripts/evaluate.py --model_dir D --data toy_maze=/tmp/toy/toy_maze --image_size 112,56

Model: `--model_dir` (an HF directory), or `--checkpoint` (a run's results_dir, its
checkpoints/ folder or one step of it; the latest complete step by default), whose `--params`
item is restored into the model of `--model_dir`, or of the `model_path` saved with the run.
Data and prompt options: `--config` (a configs/*.py file), else the config saved with
`--checkpoint`; `--data name=path` replaces the datasets. Default split: `eval` (the pipeline's
held-out split: held-out train rows plus every row of non-train files).
Context: `student` ([system?, image, question]) or `teacher` (plus the VT images; with
`--noise_vt` the VT pixels are noise). `--temperature 0` (default) is greedy decoding.

Writes `<out>/<name>_generations.jsonl`, `<name>_summary.json` and `<name>_table.md`, name =
`<context>[_noise_vt]` (with `--checkpoint` of step N:
`step<N>_<context>[_noise_vt][_ema]_evaluate`, beside the trainer's own `step<N>_<context>`
files), and prints the table. `--out` defaults to `<run>/eval/` with
`--checkpoint` (next to the evaluations the trainer writes there), else `results/eval/`.

The paper's benchmarks (Visual-OPSD Table 2), from VLMEvalKit's TSV files in one folder:

    python scripts/evaluate.py --checkpoint results/run --benchmarks all --data_dir ~/LMUData \
        [--limit N] [--seeds 0,1,2] [--harness_sampling] [--batch_size 16]
        [--system_prompt_file F] [--image_transform harness|run] [--chartqa_parse harness|loose]

greedy with 1024 new tokens (the paper's protocol; `--harness_sampling`: the harness's
temperature 0.3 and 4096 tokens), scored without a judge (opsd_jax/evaluation/benchmarks;
ChartQA's tagged answers parsed as the harness parses them, `--chartqa_parse loose`: units,
currency and thousands commas stripped; the table names the parse); writes
`<out>/benchmarks/benchmark_records.jsonl`, `benchmark_summary.json` and `benchmark_table.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from opsd_jax import run_config
from opsd_jax.evaluation import evaluate as evaluation
from opsd_jax.evaluation.benchmarks import registry as benchmark_registry
from opsd_jax.evaluation.benchmarks import run as benchmark_run
from opsd_jax.evaluation.benchmarks import scoring
from opsd_jax.evaluation.cli import (
    add_model_and_data_flags,
    add_sampling_flags,
    check_batch_size,
    check_sampling_flags,
    image_transform_arg,
    load_config,
    load_model,
    run_dir_of,
    sampling_settings,
    setup,
    step_dir_of,
)
from opsd_jax.parallel import distributed

# --benchmarks decodes by the paper's protocol, not by the config's sampling settings: greedy,
# 1024 new tokens; --harness_sampling: the harness's temperature 0.3 and 4096 new tokens.
PAPER_MAX_NEW_TOKENS, HARNESS_MAX_NEW_TOKENS, HARNESS_TEMPERATURE = 1024, 4096, 0.3
BENCHMARK_MAX_IMAGE_SKIPS = 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_and_data_flags(parser)
    parser.add_argument("--context", choices=evaluation.CONTEXTS, default="student")
    add_sampling_flags(
        parser,
        benchmark_defaults={
            "max_new_tokens": f"{PAPER_MAX_NEW_TOKENS}, "
            f"{HARNESS_MAX_NEW_TOKENS} with --harness_sampling",
            "max_image_skips": str(BENCHMARK_MAX_IMAGE_SKIPS),
            "temperature": f"{HARNESS_TEMPERATURE} under --harness_sampling, whatever this says",
            "seed": "not read; --seeds gives the seeds",
        },
    )
    parser.add_argument(
        "--out",
        default=None,
        help="output directory (default: RUN/eval with --checkpoint RUN, else results/eval)",
    )
    bench = parser.add_argument_group("the paper's benchmarks")
    bench.add_argument(
        "--benchmarks",
        help=f"comma-separated, or all: {','.join(benchmark_registry.PAPER_ORDER)}",
    )
    bench.add_argument("--data_dir", help="the folder of VLMEvalKit's <dataset>.tsv files")
    bench.add_argument("--limit", type=int, default=None, help="the first N rows of each dataset")
    bench.add_argument("--seeds", default="0", help="comma-separated; the scores are averaged")
    bench.add_argument(
        "--system_prompt_file",
        help="the system prompt's text, from a file, in place of the run's (e.g. the harness's "
        "thinking-mode instruction, to prompt a model exactly as the paper's tables did)",
    )
    bench.add_argument(
        "--harness_sampling",
        action="store_true",
        help=f"temperature {HARNESS_TEMPERATURE}, {HARNESS_MAX_NEW_TOKENS} new tokens (the "
        f"harness's setting) instead of greedy, {PAPER_MAX_NEW_TOKENS}",
    )
    bench.add_argument(
        "--image_transform",
        choices=("harness", "run"),
        default="harness",
        help="harness (default): the images resized as the ThinkMorph harness resizes them (VAE "
        "1024/512/16, then ViT 980/224/14); run: the run's data transform (--image_size: one "
        "transform of those bounds)",
    )
    bench.add_argument(
        "--chartqa_parse",
        choices=scoring.CHARTQA_PARSES,
        default="harness",
        help="harness (default): ChartQA's <answer> text read as the harness's relaxed accuracy "
        "reads it (a plain number, 5%% of the prediction); loose: currency, thousands commas "
        "and a unit word stripped, 5%% of the gold (can score above the harness's rule)",
    )
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    check_sampling_flags(args)
    if args.benchmarks:
        return run_benchmarks(args)
    if args.noise_vt and args.context != "teacher":
        raise SystemExit("--noise_vt only changes the teacher context: add --context teacher")

    try:
        model, tokenizer, samples, options, config, mesh = setup(args)
    except (FileNotFoundError, ValueError) as e:  # bad paths / configs: the message names them
        raise SystemExit(f"error: {e}") from None
    result = evaluation.evaluate(
        model,
        samples,
        tokenizer,
        options=options,
        context=args.context,
        batch_size=args.batch_size,
        mesh=mesh,
        sampler_layout=run_config.complete(config).sampler_layout,
        cache_dtype=run_config.cache_dtype_for(args.compute_dtype),
        log=print,
        **sampling_settings(args, config),
    )
    result.summary["settings"].update(
        model_dir=args.model_dir,
        checkpoint=args.checkpoint,
        params=args.params,
        config=args.config,
        split=args.split,
    )
    name = args.context + ("_noise_vt" if args.noise_vt else "")
    if args.checkpoint:
        # step<N>_<context>..._evaluate: beside the trainer's own step<N>_<context> files in the
        # run's eval/, never over them (the run's summary reads those as its held-out history).
        step = os.path.basename(step_dir_of(args.checkpoint))
        name += ("_ema" if args.params == "ema_params" else "") + "_evaluate"
        name = f"step{step}_{name}" if step.isdigit() else name
    out = args.out
    if out is None:
        out = (
            os.path.join(run_dir_of(args.checkpoint), "eval") if args.checkpoint else "results/eval"
        )
    paths = evaluation.save_results(result, out, name)
    print()
    print(evaluation.markdown_table(result.summary), end="")
    print()
    for kind, path in paths.items():
        print(f"{kind}: {path}")


def run_benchmarks(args) -> None:
    """--benchmarks: every file checked first, then the model loaded once and every benchmark
    decoded and scored (opsd_jax/evaluation/benchmarks/run.py)."""
    from opsd_jax.data.data_config import image_transform_from

    check_batch_size(args)
    try:
        benchmarks = benchmark_registry.benchmarks_named(args.benchmarks)
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if not args.data_dir:
        raise SystemExit("--benchmarks needs --data_dir (the folder of the <dataset>.tsv files)")
    if args.limit is not None and args.limit < 1:
        raise SystemExit(f"--limit must be >= 1, got {args.limit}")
    try:
        benchmark_run.check_files(args.data_dir, benchmarks)
        file_config, config = load_config(args)
        model, tokenizer, mesh = load_model(args, file_config, config)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    config = run_config.complete(config)
    options = run_config.prompt_options(config)
    if args.system_prompt_file:
        with open(args.system_prompt_file, encoding="utf-8") as f:
            options = dataclasses.replace(options, use_system_prompt=True, system_prompt=f.read())
    decode = benchmark_decode_settings(args)
    transform = image_transform_arg(args.image_size)
    if transform is None and args.image_transform == "run":
        transform = config.data.image_transform.to_dict()
    try:
        result = benchmark_run.evaluate_benchmarks(
            model,
            tokenizer,
            benchmarks,
            args.data_dir,
            options=options,
            decode=decode,
            image_transform=None if transform is None else image_transform_from(transform),
            seeds=seeds,
            limit=args.limit,
            chartqa_parse=args.chartqa_parse,
            mesh=mesh,
            sampler_layout=config.sampler_layout,
            cache_dtype=run_config.cache_dtype_for(args.compute_dtype),
            log=print,
        )
    except ValueError as e:  # a bad benchmark file, images the model cannot take
        raise SystemExit(f"error: {e}") from None
    out = args.out or (
        os.path.join(run_dir_of(args.checkpoint), "eval") if args.checkpoint else "results/eval"
    )
    if not distributed.is_main():  # every process decoded its share; one writes the files
        return
    paths = benchmark_run.save(result, os.path.join(out, "benchmarks"))
    print()
    print(benchmark_run.markdown_table(result["summary"]), end="")
    for kind, path in paths.items():
        print(f"{kind}: {path}")


def benchmark_decode_settings(args) -> benchmark_run.DecodeSettings:
    """--benchmarks' decoding from the flags, the paper's protocol (or the harness's sampling)
    filling what they leave open; the config's sampling settings are not read."""
    harness = args.harness_sampling
    default_max_new_tokens = HARNESS_MAX_NEW_TOKENS if harness else PAPER_MAX_NEW_TOKENS
    return benchmark_run.DecodeSettings(
        max_new_tokens=args.max_new_tokens or default_max_new_tokens,
        do_sample=harness or args.temperature > 0,
        temperature=HARNESS_TEMPERATURE if harness else (args.temperature or 1.0),
        batch_size=args.batch_size,
        max_image_skips=(
            args.max_image_skips if args.max_image_skips is not None else BENCHMARK_MAX_IMAGE_SKIPS
        ),
    )


if __name__ == "__main__":
    main()

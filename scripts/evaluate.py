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
`<context>[_noise_vt]`, and prints the table. `--out` defaults to `<run>/eval/` with
`--checkpoint` (next to the evaluations the trainer writes there), else `results/eval/`.
"""

from __future__ import annotations

import argparse
import os

from opsd_jax import run_config
from opsd_jax.evaluation import evaluate as evaluation
from opsd_jax.evaluation.cli import (
    add_model_and_data_flags,
    add_sampling_flags,
    check_sampling_flags,
    run_dir_of,
    sampling_settings,
    setup,
    step_dir_of,
)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_and_data_flags(parser)
    parser.add_argument("--context", choices=evaluation.CONTEXTS, default="student")
    add_sampling_flags(parser)
    parser.add_argument(
        "--out",
        default=None,
        help="output directory (default: RUN/eval with --checkpoint RUN, else results/eval)",
    )
    args = parser.parse_args(argv)
    check_sampling_flags(args)
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
    if args.checkpoint:  # step<N>_<context>, as the trainer names its evaluations: no overwrites
        step = os.path.basename(step_dir_of(args.checkpoint))
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


if __name__ == "__main__":
    main()

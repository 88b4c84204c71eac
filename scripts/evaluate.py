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
`<context>[_noise_vt]`, and prints the table.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from opsd_jax import evaluation
from opsd_jax.data.sources import SPLITS


def add_model_and_data_flags(parser: argparse.ArgumentParser) -> None:
    """Flags shared with scripts/kl_diagnostic.py."""
    model = parser.add_argument_group("model")
    model.add_argument("--model_dir", help="HF directory (llm_config.json, vit_config.json, ...)")
    model.add_argument("--checkpoint", help="training checkpoint: results_dir, checkpoints/ or a "
                       "step directory; its params are restored into the model")  # fmt: skip
    model.add_argument("--params", choices=("params", "ema_params"), default="params",
                       help="checkpoint item to restore (ema_params: the EMA teacher)")  # fmt: skip
    model.add_argument("--weights", choices=("ema", "model"), default=None,
                       help="HF weight file (default: ema.safetensors if present)")  # fmt: skip
    model.add_argument("--compute_dtype", choices=("float32", "bfloat16"), default=None,
                       help="default: the run config's, else bfloat16")  # fmt: skip
    data = parser.add_argument_group("data")
    data.add_argument("--config", help="configs/<name>.py: datasets and prompt options")
    data.add_argument("--data", action="append", default=[], metavar="NAME=PATH",
                      help="a dataset (repeatable); replaces the config's datasets")  # fmt: skip
    data.add_argument("--split", choices=SPLITS, default="eval")
    data.add_argument("--num_samples", type=int, default=None,
                      help="at most this many samples per dataset (default: all)")  # fmt: skip
    data.add_argument("--image_size", default=None, metavar="MAX,MIN",
                      help="ViT resize bounds (default: the config's, else BAGEL's 980,378)")  # fmt: skip
    data.add_argument("--noise_vt", action="store_true",
                      help="teacher context: VT images replaced by Gaussian noise (control)")  # fmt: skip
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)


def image_transform_arg(text: str | None):
    if text is None:
        return None
    try:
        max_size, min_size = (int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"--image_size {text!r}: expected MAX,MIN (two integers)") from None
    return {
        "max_size": max_size,
        "min_size": min_size,
        "stride": 14,
        "max_pixels": max_size * max_size,
    }


def setup(args, log=print):
    """(model, tokenizer, samples, prompt options, run config) from the shared flags."""
    from opsd_jax.mesh import make_mesh

    if args.batch_size < 1:
        raise SystemExit(f"--batch_size must be >= 1, got {args.batch_size}")
    if args.num_samples is not None and args.num_samples < 1:
        raise SystemExit(f"--num_samples must be >= 1, got {args.num_samples}")
    file_config = evaluation.load_config_file(args.config) if args.config else None
    run_config = None
    if args.checkpoint:
        run_config = evaluation.checkpoint_config(evaluation.checkpoint_step_dir(args.checkpoint))
    config = file_config if file_config is not None else run_config
    # Data first: a wrong path fails before the (possibly long) model load.
    data_config = evaluation.data_config_from(config, args.data,
                                              image_transform_arg(args.image_size))  # fmt: skip
    model_dir = args.model_dir
    if model_dir is None and file_config is not None and not args.checkpoint:
        model_dir = evaluation.model_dir_from_config(file_config)
    # One compute dtype for the model and the sampler's cache: the flag, else the run's.
    args.compute_dtype = args.compute_dtype or (config or {}).get("compute_dtype") or "bfloat16"
    mesh = make_mesh()
    model, tokenizer, _ = evaluation.load_model(
        model_dir, args.checkpoint, which=args.params, compute_dtype=args.compute_dtype,
        mesh=mesh, weights=args.weights, log=log,
    )  # fmt: skip
    # The images' patches and position ids follow the model's ViT (patch size, position grid).
    samples = evaluation.load_eval_samples(data_config.for_model(model.config), args.split,
                                           args.num_samples, log=log)  # fmt: skip
    options = evaluation.prompt_options_from_config(config or {}, noise_vt=args.noise_vt)
    return model, tokenizer, samples, options, config, mesh


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_and_data_flags(parser)
    parser.add_argument("--context", choices=evaluation.CONTEXTS, default="student")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy decoding; > 0 samples at this temperature")  # fmt: skip
    parser.add_argument("--max_new_tokens", type=int, default=None,
                        help="default: the config's sample_max_new_tokens, else 1024")  # fmt: skip
    parser.add_argument("--max_image_skips", type=int, default=None,
                        help="default: the config's sample_max_image_skips, else 0")  # fmt: skip
    parser.add_argument("--out", default="results/eval", help="output directory")
    args = parser.parse_args(argv)
    if args.temperature < 0:
        raise SystemExit(f"--temperature must be >= 0, got {args.temperature}")
    if args.noise_vt and args.context != "teacher":
        raise SystemExit("--noise_vt only changes the teacher context: add --context teacher")

    try:
        model, tokenizer, samples, options, config, mesh = setup(args)
    except (FileNotFoundError, ValueError) as e:  # bad paths / configs: the message names them
        raise SystemExit(f"error: {e}") from None
    config = config or {}
    max_new_tokens = args.max_new_tokens or config.get("sample_max_new_tokens", 1024)
    max_image_skips = (args.max_image_skips if args.max_image_skips is not None
                       else config.get("sample_max_image_skips", 0))  # fmt: skip
    result = evaluation.evaluate(
        model, samples, tokenizer, options=options, context=args.context,
        max_new_tokens=max_new_tokens, do_sample=args.temperature > 0,
        temperature=args.temperature or 1.0, batch_size=args.batch_size,
        max_image_skips=max_image_skips, seed=args.seed, mesh=mesh,
        cache_dtype=evaluation.cache_dtype_for(args.compute_dtype),
        log=print,
    )  # fmt: skip
    result.summary["settings"].update(
        model_dir=args.model_dir, checkpoint=args.checkpoint, params=args.params,
        config=args.config, split=args.split,
    )  # fmt: skip
    name = args.context + ("_noise_vt" if args.noise_vt else "")
    paths = evaluation.save_results(result, args.out, name)
    print()
    print(evaluation.markdown_table(result.summary), end="")
    print()
    for kind, path in paths.items():
        print(f"{kind}: {path}")


if __name__ == "__main__":
    main()

"""What the evaluation command lines share (scripts/evaluate.py, generate.py, kl_diagnostic.py):
the model, data and sampling flags, and the set-up they describe (a model from an HF directory or
a training checkpoint, its tokenizer, the held-out samples, the run's mesh)."""

from __future__ import annotations

import argparse
import os

from opsd_jax import run_config
from opsd_jax.data.sources import SPLITS
from opsd_jax.evaluation import evaluate as evaluation
from opsd_jax.evaluation.model_loader import load_model as load_model_from
from opsd_jax.io import saved_items


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The model (HF directory or training checkpoint) and the config that goes with it; shared
    with scripts/kl_diagnostic.py and scripts/generate.py."""
    model = parser.add_argument_group("model")
    model.add_argument("--model_dir", help="HF directory (llm_config.json, vit_config.json, ...)")
    model.add_argument(
        "--checkpoint",
        help="training checkpoint: results_dir, checkpoints/ or a "
        "step directory; its params are restored into the model",
    )
    model.add_argument(
        "--params",
        choices=("params", "ema_params"),
        default="params",
        help="checkpoint item to restore (ema_params: the EMA teacher)",
    )
    model.add_argument(
        "--weights",
        choices=("ema", "model"),
        default=None,
        help="HF weight file (default: ema.safetensors if present)",
    )
    model.add_argument(
        "--compute_dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="default: the run config's, else bfloat16",
    )
    model.add_argument(
        "--config",
        help="configs/<name>.py: datasets, prompt options, image size "
        "(default: the config saved with --checkpoint)",
    )
    model.add_argument(
        "--image_size",
        default=None,
        metavar="MAX,MIN",
        help="ViT resize bounds (default: the config's, else BAGEL's 980,378)",
    )


def add_model_and_data_flags(parser: argparse.ArgumentParser) -> None:
    """Model flags plus held-out data flags; shared with scripts/kl_diagnostic.py."""
    add_model_flags(parser)
    data = parser.add_argument_group("data")
    data.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a dataset (repeatable); replaces the config's datasets",
    )
    data.add_argument("--split", choices=SPLITS, default="eval")
    data.add_argument(
        "--num_samples",
        type=int,
        default=None,
        help="at most this many samples from EACH dataset, not in total (default: all)",
    )
    data.add_argument(
        "--noise_vt",
        action="store_true",
        help="teacher context: VT images replaced by Gaussian noise (control)",
    )
    parser.add_argument(
        "--batch_size",
        type=int,
        default=8,
        help="the engine's slots: rows decoding at once (each prompt takes the next free slot)",
    )


def add_sampling_flags(
    parser: argparse.ArgumentParser, benchmark_defaults: dict[str, str] | None = None
) -> None:
    """Decoding flags; shared with scripts/generate.py (see sampling_settings for defaults).
    benchmark_defaults: flag name -> the default of scripts/evaluate.py's --benchmarks mode, which
    does not read the config's sampling settings; the flag's help names it too."""
    benchmark_defaults = benchmark_defaults or {}

    def benchmark_note(name: str) -> str:
        benchmark = benchmark_defaults.get(name)
        return f"; with --benchmarks: {benchmark}" if benchmark else ""

    def default_help(name: str, config_field: str) -> str:
        return f"default: the config's {config_field}{benchmark_note(name)}"

    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help=f"0 = greedy decoding; > 0 samples at this temperature{benchmark_note('temperature')}",
    )
    parser.add_argument(
        "--max_new_tokens",
        type=int,
        default=None,
        help="total over image-skip rounds "
        f"({default_help('max_new_tokens', 'sample_max_new_tokens')})",
    )
    parser.add_argument(
        "--max_image_skips",
        type=int,
        default=None,
        help="extra rounds after an <image_start> the model cannot draw "
        f"({default_help('max_image_skips', 'sample_max_image_skips')})",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help=f"random stream of sampling (with --temperature > 0){benchmark_note('seed')}",
    )


def check_batch_size(args) -> None:
    """--batch_size (add_model_and_data_flags), before any loading: a bad value fails at once."""
    if args.batch_size < 1:
        raise SystemExit(f"--batch_size must be >= 1, got {args.batch_size}")


def check_sampling_flags(args) -> None:
    """Before any loading: a bad value fails at once."""
    if args.temperature < 0:
        raise SystemExit(f"--temperature must be >= 0, got {args.temperature}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise SystemExit(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if args.max_image_skips is not None and args.max_image_skips < 0:
        raise SystemExit(f"--max_image_skips must be >= 0, got {args.max_image_skips}")


def sampling_settings(args, config) -> dict:
    """evaluation.evaluate / evaluation.answer keyword arguments from the sampling flags, the
    run's config (or the defaults, configs/common.py) filling what the flags leave open."""
    config = run_config.complete(config)
    return {
        "max_new_tokens": args.max_new_tokens or config.sample_max_new_tokens,
        "max_image_skips": (
            args.max_image_skips
            if args.max_image_skips is not None
            else config.sample_max_image_skips
        ),
        "do_sample": args.temperature > 0,
        "temperature": args.temperature or 1.0,
        "seed": args.seed,
    }


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


def step_dir_of(path) -> str:
    """`--checkpoint`'s step directory (saved_items.step_dir_of), its errors naming the flag."""
    try:
        return saved_items.step_dir_of(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--checkpoint {path}: {e}") from None


def run_dir_of(path) -> str:
    """The training run a checkpoint belongs to: the folder holding its `checkpoints/` (or, for
    a checkpoint directory named otherwise, that directory itself)."""
    root = os.path.dirname(step_dir_of(path))
    return os.path.dirname(root) if os.path.basename(root) == "checkpoints" else root


def load_config(args):
    """(the --config file's config or None, the config in use: that file's, else the one saved
    with --checkpoint, else None)."""
    file_config = run_config.load_config_file(args.config) if args.config else None
    saved_config = None
    if args.checkpoint:
        saved_config = saved_items.saved_config(step_dir_of(args.checkpoint))
    return file_config, file_config if file_config is not None else saved_config


def load_model(args, file_config, config, log=print):
    """(model, tokenizer, mesh) from the model flags; sets args.compute_dtype to the one used."""
    from opsd_jax.parallel.mesh import make_mesh

    model_dir = args.model_dir
    if model_dir is None and file_config is not None and not args.checkpoint:
        model_dir = run_config.model_dir(file_config)
    # One compute dtype for the model and the sampler's cache: the flag, else the run's.
    args.compute_dtype = args.compute_dtype or run_config.complete(config).compute_dtype
    mesh = make_mesh()
    model, tokenizer, _ = load_model_from(
        model_dir,
        args.checkpoint,
        which=args.params,
        compute_dtype=args.compute_dtype,
        mesh=mesh,
        weights=args.weights,
        log=log,
    )
    return model, tokenizer, mesh


def setup(args, log=print):
    """(model, tokenizer, samples, prompt options, run config, mesh) from the shared flags."""
    check_batch_size(args)
    if args.num_samples is not None and args.num_samples < 1:
        raise SystemExit(f"--num_samples must be >= 1, got {args.num_samples}")
    file_config, config = load_config(args)
    # Data first: a wrong path fails before the (possibly long) model load.
    data_config = run_config.data_config(config, args.data, image_transform_arg(args.image_size))
    model, tokenizer, mesh = load_model(args, file_config, config, log=log)
    # The images' patches and position ids follow the model's ViT (patch size, position grid).
    samples = evaluation.load_eval_samples(
        data_config.for_model(model.config), args.split, args.num_samples, log=log
    )
    options = run_config.prompt_options(config, noise_vt=args.noise_vt)
    return model, tokenizer, samples, options, config, mesh

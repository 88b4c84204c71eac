"""Answer one image and question with a BAGEL / ThinkMorph model or a training checkpoint.

    python scripts/generate.py --checkpoint results/tiny --image maze.png --question "..."
    python scripts/generate.py --model_dir /data/ThinkMorph-7B --image chart.png \
        --question "Which bar is tallest?" [--temperature 0.7] [--max_image_skips 1]

The PyTorch project's inference demo, on our sampler: the prompt is what the student sees at
training and test time ([system prompt?, image, question], the config's wording), decoding is
greedy (`--temperature 0`, the default) or sampled, and a round that ends asking for an image
(`<image_start>`, which an understanding-only model cannot draw) is followed by another, up to
`--max_image_skips` times. Model flags are those of scripts/evaluate.py: `--model_dir` (an HF
directory) or `--checkpoint` (a train.py results_dir, its checkpoints/ folder or one step of it),
with the config saved there or given by `--config`.

Prints the completion on stdout (control characters escaped) and, on stderr, the loading log
and one line with the extracted answer, the token count and the rounds used.
"""

from __future__ import annotations

import argparse
import sys

from opsd_jax import run_config
from opsd_jax.data.data_config import image_transform_from
from opsd_jax.evaluation import answers
from opsd_jax.evaluation import evaluate as evaluation
from opsd_jax.evaluation.cli import (
    add_model_flags,
    add_sampling_flags,
    check_sampling_flags,
    image_transform_arg,
    load_config,
    load_model,
    sampling_settings,
)
from opsd_jax.training.metrics import escape_controls


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", required=True, help="the problem image (any format PIL reads)")
    parser.add_argument("--question", required=True)
    add_model_flags(parser)
    add_sampling_flags(parser)
    args = parser.parse_args(argv)
    check_sampling_flags(args)
    # --image_size is parsed and built here, before the (possibly long) model load.
    transform = image_transform_arg(args.image_size)
    if transform is not None:
        try:
            transform = image_transform_from(transform)
        except ValueError as e:  # e.g. "0,0": ImageTransform names the field and the value
            raise SystemExit(f"--image_size {args.image_size!r}: {e}") from None

    from PIL import Image

    def log(line):
        print(line, file=sys.stderr, flush=True)

    try:
        image = Image.open(args.image)
        image.load()
    except OSError as e:  # missing or unreadable: PIL's message names the file
        raise SystemExit(f"error: --image {args.image}: {e}") from None
    try:
        file_config, config = load_config(args)
        model, tokenizer, mesh = load_model(args, file_config, config, log=log)
    except (FileNotFoundError, ValueError) as e:  # bad paths / configs: the message names them
        raise SystemExit(f"error: {e}") from None
    config = run_config.complete(config)
    if transform is None:
        transform = (config.get("data") or {}).get("image_transform")
    text, completions = evaluation.answer(
        model,
        tokenizer,
        image,
        args.question,
        options=run_config.prompt_options(config),
        image_transform=transform,
        mesh=mesh,
        cache_dtype=run_config.cache_dtype_for(args.compute_dtype),
        sampler_layout=config.sampler_layout,
        **sampling_settings(args, config),
    )
    print(escape_controls(text, keep="\n\t"), flush=True)
    ended = "ended" if completions.finished[0] else "ran out of tokens"
    log(
        f"answer: {answers.extract_answer(text)!r}; {int(completions.lengths[0])} tokens, "
        f"{int(completions.rounds[0])} round(s), {ended}"
    )


if __name__ == "__main__":
    main()

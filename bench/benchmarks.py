"""Samples per second of the paper-benchmark evaluation (opsd_jax/evaluation/benchmarks) on this
machine: the toy model on a synthetic multiple-choice TSV, decoded at batch 1 and at batch 16 in
one process (each after a warm-up pass that compiles its shapes).

    python bench/benchmarks.py [--rows 32] [--new-tokens 32] [--batch-sizes 1 16] [--harness-images]

`--harness-images`: the images go the harness's way (a JPEG file, the VAE resize to 512+ px,
the ViT transform: about 37 x 37 patches each here) instead of one small 56 px transform, so
the figure includes that host-side work and the longer prompts.
"""

import argparse
import os
import tempfile
import time

import numpy as np
from PIL import Image

from opsd_jax import run_config
from opsd_jax.data.image_transform import ImageTransform
from opsd_jax.evaluation.benchmarks import registry, run, tsv
from opsd_jax.io.hf_load import load_hf
from opsd_jax.parallel.mesh import make_mesh
from opsd_jax.toy import data as toy_data
from opsd_jax.toy import model as toy_model


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--harness-images", action="store_true")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="bench_benchmarks_")
    corpus = toy_data.toy_corpus_text(num_train=4, num_test=2).splitlines()
    model_dir = toy_model.write_toy_model(os.path.join(work, "model"), corpus=corpus)
    mesh = make_mesh(devices=None)
    model, _, tokenizer = load_hf(model_dir, mesh=mesh)
    rng = np.random.default_rng(0)
    rows = [
        dict(
            index=i,
            image=Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8)),
            question=f"Which shape is shown? ({i})",
            A="circle",
            B="square",
            C="triangle",
            answer="B",
        )
        for i in range(args.rows)
    ]
    data_dir = os.path.join(work, "data")
    os.makedirs(data_dir)
    tsv.write_tsv(os.path.join(data_dir, "MMVP.tsv"), rows)
    benchmarks = registry.benchmarks_named("mmvp")
    print(
        f"toy model, {args.rows} multiple-choice rows, {args.new_tokens} new tokens, mesh "
        f"{dict(mesh.shape)}, images: {'harness' if args.harness_images else '56 px'}"
    )
    for batch_size in args.batch_sizes:
        settings = dict(
            options=run_config.prompt_options({}),
            decode=run.DecodeSettings(max_new_tokens=args.new_tokens, batch_size=batch_size),
            image_transform=None if args.harness_images else ImageTransform(56, 28, 14),
            mesh=mesh,
        )
        run.evaluate_benchmarks(
            model, tokenizer, benchmarks, data_dir, limit=batch_size, **settings
        )  # warm-up: compiles this batch's shapes
        start = time.perf_counter()
        result = run.evaluate_benchmarks(model, tokenizer, benchmarks, data_dir, **settings)
        seconds = time.perf_counter() - start
        tokens = np.mean([r["output_tokens"] for r in result["records"]])
        print(
            f"batch {batch_size:3d}: {args.rows / seconds:8.2f} samples/s "
            f"({seconds:.2f} s for {args.rows} rows, {tokens:.1f} output tokens per sample)"
        )


if __name__ == "__main__":
    main()

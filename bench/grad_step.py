"""Grad-step time of the ~64M model on this machine's devices: the OPSD grad step alone.

Builds the m64 BAGEL of bench/sampler.py (`--model tiny`: the tiny one, for trying the script
out in seconds) on a mesh over the available devices (one CPU device by default; `--devices 8`
simulates eight), one micro-batch of aligned student / teacher packs
with an image per sample, and times the jitted grad step (student forward + backward, teacher
forward, JSD at the paper's settings). Prints the compile time, seconds per call and tokens/s.
Run it from two checkouts in one session to compare a change against main.

    python bench/grad_step.py [--devices 8] [--steps 5] [--compute-dtype bfloat16] [--model tiny]
"""

from __future__ import annotations

import argparse
import os
import time
import types


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--compute-dtype", default="bfloat16")
    parser.add_argument("--model", choices=("m64", "tiny"), default="m64")
    args = parser.parse_args()
    if args.devices > 1:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.devices}"
        )

    import jax
    import numpy as np
    from flax import nnx

    from models.bagel import Bagel
    from models.configs import BagelConfig
    from opsd_jax import run_config
    from opsd_jax.data.image_transform import VitImageInputs, vit_position_ids
    from opsd_jax.data.opsd_packs import build_training_packs
    from opsd_jax.data.packing import SpecialTokens
    from opsd_jax.parallel import mesh as mesh_lib
    from opsd_jax.training import train_step

    config = BagelConfig.small_64m() if args.model == "m64" else BagelConfig.tiny()
    config = config.replace(llm=dict(compute_dtype=args.compute_dtype))
    mesh = mesh_lib.make_mesh()
    model = mesh_lib.create_sharded_model(lambda: Bagel(config, rngs=nnx.Rngs(0)), mesh)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(0)
    vocab = config.llm.vocab_size
    special = SpecialTokens(vocab - 4, vocab - 3, vocab - 2, vocab - 1)

    def encode(text):  # a character per id: only the packs' shapes matter here
        return [32 + ord(c) % 900 for c in text]

    def image(h, w):
        patches = rng.uniform(-1, 1, (h * w, 588)).astype(np.float32)
        return VitImageInputs(patches, vit_position_ids(h, w), h, w)

    # BAGEL-structured samples (problem image 12x16 patches, one 12x12 VT image, a question,
    # two thoughts): packs of a few hundred tokens, as a small model's would be.
    samples = [
        types.SimpleNamespace(
            pid=f"s{i}",
            question="q" * (20 + i),
            answer="A",
            problem_image=image(12, 16),
            vt_images=[image(12, 12)],
            thoughts=["t0", "t1"],
        )
        for i in range(args.rows)
    ]
    completions = [rng.integers(10, 1000, 96).tolist() for _ in range(args.rows)]
    options = run_config.prompt_options(
        dict(system_prompt="ab", reference_intro="c", transition_prompt="d")
    )
    packs = build_training_packs(
        samples, completions, encode, options, special, num_rows=args.rows, max_forward_tokens=4096
    )
    tokens = int((packs.student.segment_ids > 0).sum() + (packs.teacher.segment_ids > 0).sum())
    settings = run_config.loss_settings({"samples_per_micro_batch": args.rows})
    grad_step = train_step.make_grad_step(graphdef, rest, settings, "ema")
    with mesh_lib.use_mesh(mesh):
        put = lambda p: jax.tree.map(  # noqa: E731
            lambda x: jax.device_put(x, mesh_lib.batch_sharding(mesh, x.ndim)), p
        )
        student, teacher = put(packs.student), put(packs.teacher)
        t0 = time.perf_counter()
        compiled = grad_step.lower(params, params, student, teacher).compile()
        compile_s = time.perf_counter() - t0
        jax.block_until_ready(compiled(params, params, student, teacher))
        t0, cpu0 = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            jax.block_until_ready(compiled(params, params, student, teacher))
        step_s = (time.perf_counter() - t0) / args.steps
        # CPU seconds of this process: less sensitive than wall time to other load on the machine.
        cpu_s = (time.process_time() - cpu0) / args.steps
    print(
        f"{args.model} grad step, {len(jax.devices())} device(s), {args.compute_dtype}, student "
        f"{packs.student.tokens.shape} teacher {packs.teacher.tokens.shape}: compile "
        f"{compile_s:.1f} s, {step_s:.3f} s per step ({cpu_s:.3f} CPU s), "
        f"{tokens / step_s:.0f} tokens/s"
    )


if __name__ == "__main__":
    main()

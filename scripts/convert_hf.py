"""Convert a BAGEL / ThinkMorph HF checkpoint directory to our params (orbax) and back.

    python scripts/convert_hf.py hf-to-jax --hf_dir D --out O [--gen_expert] [--weights ema]
    python scripts/convert_hf.py jax-to-hf --ckpt O --source D --out D2 [--item ema_params]
        [--adapters_only]

hf-to-jax loads D with `opsd_jax.io.hf_load.load_hf` on a mesh over every local device (each tensor
goes straight into its shard) and saves the params as the orbax item `O/params`, plus
`O/bagel_config.json`. jax-to-hf restores an orbax params item (this script's output, or a
training checkpoint's `params` / `ema_params` in `<dir>/<step>/`, the latest step if `--ckpt`
is the checkpoint directory) onto the same kind of mesh, and writes D2 with
`opsd_jax.io.hf_export.save_hf`: the source's key names, shapes, dtypes and file layout, tensors we do
not hold copied from the source unchanged, and the other files of D copied. Both directions
check everything before writing, so a failed conversion leaves no partial output.

A LoRA run's checkpoint (lora_rank > 0) holds adapters only: jax-to-hf loads its base from D
(refused unless D holds the weights the adapters were trained on), folds the adapters in and
writes the merged model the same way; `--adapters_only` writes the adapters alone, PEFT-named
over BAGEL's HF modules (opsd_jax/io/lora_export.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
from flax import nnx

from opsd_jax.io import checkpoint, hf_export, hf_layout, hf_load, lora_export, saved_items
from opsd_jax.io.safetensors_io import SafetensorsError, WeightDirectory
from opsd_jax.parallel.mesh import make_mesh


def hf_to_jax(args) -> None:
    start = time.time()
    mesh = make_mesh()
    model, config, tokenizer = hf_load.load_hf(
        args.hf_dir,
        mesh=mesh,
        dtype=jnp.dtype(args.dtype),
        build_gen_expert=args.gen_expert,
        weights=args.weights,
        progress=True,
    )
    params = hf_export.flat_params(model)
    count = sum(value.size for value in params.values())
    trainable = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    item = saved_items.save_model_params(nnx.state(model, nnx.Param), args.out)
    if jax.process_index() == 0:
        with open(os.path.join(args.out, "bagel_config.json"), "w") as f:
            json.dump(dataclasses.asdict(config), f, indent=2)
    print(
        f"loaded {args.hf_dir}: {len(params)} arrays of {count:,} values ({args.dtype}): "
        f"{trainable:,} trainable parameters and {count - trainable:,} in the fixed 2-D "
        f"sin-cos position table; mesh {dict(mesh.shape)}; gen expert "
        f"{'loaded' if args.gen_expert else 'skipped'}"
    )
    print(
        f"tokenizer: {tokenizer.vocab_length} ids ({tokenizer.num_added} added), "
        f"{tokenizer.special_tokens()}"
    )
    print(f"wrote {item} in {time.time() - start:.1f}s")


def jax_to_hf(args) -> None:
    start = time.time()
    is_lora = lora_export.lora_checkpoint(args.ckpt) is not None
    if args.adapters_only:
        if not is_lora:
            raise checkpoint.CheckpointError(
                f"--adapters_only: {args.ckpt} is not a LoRA checkpoint (it holds the whole model)"
            )
        out = lora_export.save_adapters(
            args.ckpt, args.source, args.out, make_mesh(), which=args.item
        )
        print(
            f"wrote the {args.item} adapters of {args.ckpt} to {out} in {time.time() - start:.1f}s"
        )
        return
    if is_lora:  # the base from --source, the adapters folded in
        merged = lora_export.restore_merged(args.ckpt, args.source, make_mesh(), which=args.item)
        params = hf_export.flat_params(merged)
        print(f"{args.ckpt}: LoRA adapters ({args.item}) merged into the base of {args.source}")
    else:
        params = hf_export.restore_for_export(args.ckpt, args.source, make_mesh(), which=args.item)
    out = hf_export.save_hf(
        params, args.out, args.source, weights=args.weights, overwrite=args.overwrite, progress=True
    )
    source = WeightDirectory(args.source, args.weights)
    ours = 0
    for key in source.keys():
        matched = hf_layout.match_key(key)
        ours += matched is not None and matched[0].target in params
    print(f"restored {args.item} of {args.ckpt}: {len(params)} params")
    print(
        f"wrote {out}: {len(source.keys())} tensors ({ours} from our params, "
        f"{len(source.keys()) - ours} copied from {args.source}) in {time.time() - start:.1f}s"
    )


def out_problem(args) -> str | None:
    """Why the conversion cannot write --out, or None; checked before anything loads."""
    if args.command == "hf-to-jax":
        params_dir = os.path.join(args.out, checkpoint.PARAMS)
        if os.path.exists(params_dir):
            return (
                f"--out {args.out} already holds {checkpoint.PARAMS}/: remove it or give "
                "another --out"
            )
        return None
    if os.path.exists(args.out) and os.path.realpath(args.out) == os.path.realpath(args.source):
        return f"--out {args.out} is the --source directory: give a new one"
    if not os.path.exists(args.out):
        return None
    if args.adapters_only:  # lora_export.save_adapters writes a new directory only
        return f"--out {args.out} exists: --adapters_only writes a new directory; remove it"
    if not args.overwrite:
        return f"--out {args.out} exists: pass --overwrite to replace it, or give another --out"
    return None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    to_jax = commands.add_parser("hf-to-jax", help="HF directory -> orbax params")
    to_jax.add_argument("--hf_dir", required=True, help="BAGEL / ThinkMorph directory")
    to_jax.add_argument(
        "--out", required=True, help="output directory (gets params/, which must not exist)"
    )
    to_jax.add_argument(
        "--gen_expert",
        action="store_true",
        help="also load the *_moe_gen weights (image generation expert)",
    )
    to_jax.add_argument(
        "--weights", default=None, help="ema or model (default: ema.safetensors if present)"
    )
    to_jax.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="parameter dtype"
    )
    to_jax.set_defaults(run=hf_to_jax)
    to_hf = commands.add_parser("jax-to-hf", help="orbax params -> HF directory")
    to_hf.add_argument(
        "--ckpt", required=True, help="hf-to-jax output, a training step dir, or its checkpoint dir"
    )
    to_hf.add_argument("--source", required=True, help="the HF directory the params came from")
    to_hf.add_argument(
        "--out", required=True, help="new HF directory (must not exist unless --overwrite)"
    )
    to_hf.add_argument(
        "--item",
        default=checkpoint.PARAMS,
        choices=(checkpoint.PARAMS, checkpoint.EMA_PARAMS),
        help="orbax item (default: params)",
    )
    to_hf.add_argument("--weights", default=None, help="source weights: ema or model")
    to_hf.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    to_hf.add_argument(
        "--adapters_only",
        action="store_true",
        help="a LoRA checkpoint: write its adapters alone (PEFT names), not the merged model",
    )
    to_hf.set_defaults(run=jax_to_hf)
    args = parser.parse_args(argv)
    problem = out_problem(args)
    if problem:  # before any load: the params, a whole model, can take minutes to read
        raise SystemExit(f"error: {problem}")
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} device(s)")
    try:
        args.run(args)
    except USER_ERRORS as e:  # a bad directory or file: the message names it
        raise SystemExit(f"error: {e}") from None


# What a user's input can get wrong (paths, files, checkpoints): one line, no traceback.
USER_ERRORS = (
    hf_layout.HFCheckpointError,
    SafetensorsError,
    checkpoint.CheckpointError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)


if __name__ == "__main__":
    main()

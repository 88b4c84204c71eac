"""Write a tiny random BAGEL checkpoint directory in the exact HF layout of the 7B release.

What is written is described in opsd_jax/toy/model.py. Deterministic in the arguments and --seed.

    python scripts/make_toy_model.py --out /tmp/toy_bagel [--dtype fp32] [--num_shards 2]
        [--weights_name model] [--seed 0] [--corpus text.txt] [--tokenizer_vocab_size 1000]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from opsd_jax.io.tokenizer import transformers
from opsd_jax.toy.model import DTYPES, write_toy_model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument(
        "--num_shards",
        type=int,
        default=1,
        help="1 = a single file; N > 1 = N files + <name>.safetensors.index.json",
    )
    parser.add_argument(
        "--weights_name",
        choices=("ema", "model"),
        default="ema",
        help="ema.safetensors (BAGEL) or model.safetensors (ThinkMorph)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", help="text file to train the tokenizer on (one line each)")
    parser.add_argument(
        "--tokenizer_vocab_size",
        type=int,
        default=1000,
        help="upper bound on tokenizer ids, specials included (<= 1024)",
    )
    args = parser.parse_args(argv)
    corpus = None
    if args.corpus:
        corpus = [line for line in Path(args.corpus).read_text().splitlines() if line.strip()]
    out = write_toy_model(
        args.out,
        dtype=args.dtype,
        num_shards=args.num_shards,
        weights_name=args.weights_name,
        seed=args.seed,
        corpus=corpus,
        tokenizer_vocab_size=args.tokenizer_vocab_size,
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.fspath(out), local_files_only=True)
    print(
        f"wrote {out}: {len(tokenizer)} tokenizer ids, weights "
        f"{', '.join(sorted(p.name for p in out.glob('*.safetensors*')))}"
    )


if __name__ == "__main__":
    main()

"""Make a small synthetic visual-reasoning corpus in the ThinkMorph parquet layout (and JSONL).

The tasks and the layout are described in opsd_jax/toy/tasks.py and opsd_jax/toy/data.py.
Deterministic: the same --seed (and counts) gives byte-identical files. Usage, from the repo root:

    python scripts/make_toy_data.py --out /tmp/toy [--seed 0] [--jsonl] [--corpus_out corpus.txt]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from opsd_jax.toy.data import toy_corpus_text, write_toy_data
from opsd_jax.toy.tasks import ALL_TASKS, TASKS


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--num_train",
        type=int,
        default=None,
        help="train rows per task, >= 1 (default 320, opt-in tasks: DEFAULT_SIZES)",
    )
    parser.add_argument(
        "--num_test",
        type=int,
        default=None,
        help="held-out rows per task, >= 1 (default 64, opt-in tasks: DEFAULT_SIZES)",
    )
    parser.add_argument(
        "--tasks",
        default=",".join(TASKS),
        help=f"comma list of {ALL_TASKS} (default: {','.join(TASKS)})",
    )
    parser.add_argument("--jsonl", action="store_true", help="also write the JSONL+images layout")
    parser.add_argument("--corpus_out", default=None, help="also write the text corpus here")
    args = parser.parse_args(argv)

    # Checked before anything is written: a bad task used to stop the run after the tasks
    # before it were written, a count below 1 wrote files of no rows.
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in tasks if t not in ALL_TASKS]
    if unknown or not tasks:
        what = f"unknown task(s) {', '.join(unknown)}" if unknown else "no task named"
        raise SystemExit(f"--tasks {args.tasks!r}: {what}; known: {', '.join(ALL_TASKS)}")
    for flag, count in (("--num_train", args.num_train), ("--num_test", args.num_test)):
        if count is not None and count < 1:
            raise SystemExit(f"{flag} must be >= 1, got {count}")
    written = write_toy_data(args.out, args.seed, args.num_train, args.num_test, tasks, args.jsonl)
    for name, path in written.items():
        print(f"{name}: {path}")
    if args.corpus_out:
        with open(args.corpus_out, "w", encoding="utf-8") as f:
            f.write(toy_corpus_text(args.seed, args.num_train, args.num_test, tasks))
        print(f"corpus: {args.corpus_out}")


if __name__ == "__main__":
    main()

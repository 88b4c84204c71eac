"""K_gen of a frozen model: per-token KL(teacher with VT ‖ student without VT) on reference text.

    python scripts/kl_diagnostic.py --model_dir D --config configs/tiny.py [--num_samples 32]
    python scripts/kl_diagnostic.py --checkpoint results/tiny [--params ema_params]

The model scores each sample's reference solution (its text-only thought plus the answer, as
`<think>...</think><answer>...</answer>`) teacher-forced twice: in the teacher's context (with
the VT images) and in the student's; K_gen is the mean full-vocabulary KL between the two
next-token distributions over the reference tokens (opsd_jax/evaluation/kl_diagnostic.py). The same is
computed with the VT pixels replaced by noise (the control), and both are printed side by side
per dataset. Model / data / prompt flags are those of scripts/evaluate.py.

Writes `<out>/kl_summary.json`, `<out>/kl_per_sample.jsonl` and `<out>/kl_histogram.png`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from opsd_jax import run_config
from opsd_jax.evaluation import kl_diagnostic
from opsd_jax.evaluation.cli import add_model_and_data_flags, setup

SETTINGS = {"VT": False, "noise VT": True}  # label -> noise_vt


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_and_data_flags(parser)
    parser.add_argument(
        "--chunk_size",
        type=int,
        default=64,
        help="loss entries whose [rows, chunk, vocab] logits are live at once",
    )
    parser.add_argument(
        "--max_forward_tokens",
        type=int,
        default=None,
        help="teacher pack length, >= 1 (default: the config's, else 10240); a sample whose "
        "teacher context is longer is dropped",
    )
    parser.add_argument(
        "--no_noise_control", action="store_true", help="skip the noise-VT control pass"
    )
    parser.add_argument("--out", default="results/kl_diagnostic", help="output directory")
    args = parser.parse_args(argv)
    if args.chunk_size < 1:
        raise SystemExit(f"--chunk_size must be >= 1, got {args.chunk_size}")
    if args.max_forward_tokens is not None and args.max_forward_tokens < 1:
        # (0 is no "use the config's": leaving the flag out is.)
        raise SystemExit(f"--max_forward_tokens must be >= 1, got {args.max_forward_tokens}")
    if args.noise_vt:
        raise SystemExit(
            "--noise_vt: the noise control is always computed here (unless "
            "--no_noise_control); drop the flag"
        )

    try:
        model, tokenizer, samples, options, config, mesh = setup(args)
    except (FileNotFoundError, ValueError) as e:  # bad paths / configs: the message names them
        raise SystemExit(f"error: {e}") from None
    config = run_config.complete(config)
    if args.max_forward_tokens is None:
        max_forward_tokens = config.max_forward_tokens
    else:
        max_forward_tokens = args.max_forward_tokens
    settings = {"VT": False} if args.no_noise_control else SETTINGS
    results = {}
    for label, noise_vt in settings.items():
        results[label] = kl_diagnostic.kl_diagnostic(
            model,
            samples,
            tokenizer,
            options=dataclasses.replace(options, noise_vt=noise_vt),
            batch_size=args.batch_size,
            max_forward_tokens=max_forward_tokens,
            chunk_size=args.chunk_size,
            mesh=mesh,
            log=print,
        )
        dropped = results[label].summary["num_dropped"]
        if not results[label].summary["overall"]["num_samples"]:
            # Nothing measured: no K_gen, so no verdict and no files (the noise pass drops the
            # same samples: its contexts are as long).
            raise SystemExit(
                f"error: no sample measured: all {dropped} samples' teacher contexts are longer "
                f"than max_forward_tokens={max_forward_tokens}; raise --max_forward_tokens"
            )
        if dropped:
            print(
                f"{label}: {dropped} samples dropped (teacher context > max_forward_tokens="
                f"{max_forward_tokens})"
            )
        cut = results[label].summary["num_truncated"]
        measured = results[label].summary["overall"]["num_samples"]
        if cut == measured:
            # Every reference lost its answer to the cut: the gate has nothing to judge.
            raise SystemExit(
                f"error: no answer span measured: all {cut} measured references were cut to fit "
                f"max_forward_tokens={max_forward_tokens}; raise --max_forward_tokens"
            )
        if cut:
            print(
                f"{label}: {cut} references cut to fit max_forward_tokens={max_forward_tokens} "
                "(their answer span is left out of the gate)"
            )

    os.makedirs(args.out, exist_ok=True)
    summary = {label: result.summary for label, result in results.items()}
    decision, why = kl_diagnostic.verdict(
        results["VT"].summary, results["noise VT"].summary if "noise VT" in results else None
    )
    summary["verdict"] = {
        "decision": decision,
        "reason": why,
        "threshold": kl_diagnostic.GO_THRESHOLD,
    }
    summary["settings"] = {
        "model_dir": args.model_dir,
        "checkpoint": args.checkpoint,
        "params": args.params,
        "config": args.config,
        "split": args.split,
        "num_samples": len(samples),
        "max_forward_tokens": max_forward_tokens,
    }
    paths = {
        "summary": os.path.join(args.out, "kl_summary.json"),
        "per_sample": os.path.join(args.out, "kl_per_sample.jsonl"),
        "histogram": os.path.join(args.out, "kl_histogram.png"),
    }
    # A value not measured (NaN: e.g. a dataset none of whose samples fit) is written as null:
    # JSON has no NaN, and allow_nan=False makes sure none slips through.
    with open(paths["summary"], "w", encoding="utf-8") as f:
        json.dump(kl_diagnostic.json_ready(summary), f, indent=2, allow_nan=False)
        f.write("\n")
    with open(paths["per_sample"], "w", encoding="utf-8") as f:
        for label, result in results.items():
            f.writelines(
                json.dumps(kl_diagnostic.json_ready(dict(record, setting=label)), allow_nan=False)
                + "\n"
                for record in result.records
            )
    kl_diagnostic.save_histogram(results, paths["histogram"])
    print()
    print(kl_diagnostic.markdown_table(results), end="")
    if "noise VT" in results:
        vt, noise = (results[k].summary["overall"]["mean"] for k in ("VT", "noise VT"))
        print(f"\nK_gen(VT) - K_gen(noise VT) = {vt - noise:+.6f} nats/token")
    print(f"\nverdict: {decision}: {why}")
    print()
    for kind, path in paths.items():
        print(f"{kind}: {path}")


if __name__ == "__main__":
    main()

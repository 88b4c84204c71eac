"""Exact-match evaluation of a BAGEL-family model on held-out Visual-OPSD samples.

What: sample one completion per problem, every prompt streamed through the continuous-batching
engine (opsd_jax/sampling/engine.py), pull the final answer out of
it (answers.py), compare it with the reference, and report exact-match accuracy per dataset and
overall, the mean completion length and the share of completions that wrote an `<answer>` tag.
Two contexts:

* `student`: the prompt the policy sees at training and test time, [system?, problem image,
  question] (`opsd_packs.build_prompt_pack`);
* `teacher`: the teacher's view with the privileged visual-thought (VT) images
  (`opsd_packs.teacher_context_items`); with `noise_vt=True` (PromptOptions) the VT pixels are
  Gaussian noise, the paper's control. The gap between the two says how much the VT helps.

Why here and not in the trainer: the same code runs from `scripts/evaluate.py` (an HF directory
or a training checkpoint) and from the training loop every `eval_every` steps on the live
student (`evaluate(model, samples, tokenizer, ...)`), so both report the same numbers.
`answer(model, tokenizer, image, question)` puts one image and question through the same
prompt and engine (scripts/generate.py).

One module of over 400 lines: loading the held-out samples, the prompts of both contexts, the
batched decode, the scoring and the saved results are one flow, shared by the scripts and the
trainer.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from models.pack import Pack
from opsd_jax import run_config
from opsd_jax.data.opsd_packs import PromptOptions, build_prompt_pack, build_teacher_prompt_pack
from opsd_jax.data.packing import SpecialTokens
from opsd_jax.evaluation.answers import extract_answer, has_answer_tag, is_correct
from opsd_jax.sampling import decode_copy
from opsd_jax.sampling import engine as engine_lib
from opsd_jax.sampling import sampler as sampler_lib

CONTEXTS = ("student", "teacher")

# ----------------------------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------------------------


def build_context_prompt_pack(
    samples,
    encode,
    options: PromptOptions,
    special: SpecialTokens,
    context: str,
    num_rows: int | None = None,
    buckets: Sequence[int] | None = None,
) -> Pack:
    """Sampler prompts in the `student` or `teacher` context (lengths rounded up to `buckets`)."""
    if context == "student":
        return build_prompt_pack(samples, encode, options, special, num_rows, buckets)
    if context == "teacher":
        return build_teacher_prompt_pack(samples, encode, options, special, num_rows, buckets)
    raise ValueError(f"context={context!r}: allowed values are {', '.join(map(repr, CONTEXTS))}")


# ----------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Per-sample records and the summary of one evaluation.

    records: one dict per sample, in input order: pid, dataset, question, reference,
      generation, extracted, correct, completion_length, finished, has_answer_tag.
    summary: {"overall": metrics, "datasets": {name: metrics}, "settings": {...}}, metrics =
      num_samples, accuracy, mean_completion_length, answer_tag_rate, finished_rate (overall
      also macro_accuracy, the mean of the per-dataset accuracies).
    """

    records: list[dict[str, Any]]
    summary: dict[str, Any]

    def scalars(self, prefix: str = "eval") -> dict[str, float]:
        """Flat metrics for a MetricsLogger: `eval/accuracy`, `eval/<dataset>/accuracy`, ..."""
        out = {}
        for key, value in self.summary["overall"].items():
            out[f"{prefix}/{_SCALAR_NAMES.get(key, key)}"] = float(value)
        for name, metrics in self.summary["datasets"].items():
            for key in ("accuracy", "answer_tag_rate", "mean_completion_length"):
                out[f"{prefix}/{name}/{_SCALAR_NAMES.get(key, key)}"] = float(metrics[key])
        return out


_SCALAR_NAMES = {"mean_completion_length": "completion_length"}


def _group_metrics(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    n = len(records)
    mean = lambda key: float(np.mean([float(r[key]) for r in records])) if n else 0.0  # noqa: E731
    return {
        "num_samples": n,
        "accuracy": mean("correct"),
        "mean_completion_length": mean("completion_length"),
        "answer_tag_rate": mean("has_answer_tag"),
        "finished_rate": mean("finished"),
    }


def summarize(records: Sequence[Mapping[str, Any]], settings: Mapping[str, Any] | None = None):
    """The summary dict of `EvalResult` from per-sample records (datasets in first-seen order)."""
    by_dataset = collections.defaultdict(list)
    for record in records:
        by_dataset[record["dataset"]].append(record)
    datasets = {name: _group_metrics(group) for name, group in by_dataset.items()}
    overall = _group_metrics(records)
    overall["macro_accuracy"] = (
        float(np.mean([m["accuracy"] for m in datasets.values()])) if datasets else 0.0
    )
    return {"overall": overall, "datasets": datasets, "settings": dict(settings or {})}


# What evaluation samples with: `engine.stream` or a drop-in with its signature (tests script
# the completions): (model, prompts, rng, *, pool_size, row_ids, on_done, **engine settings).
StreamFn = Callable[..., sampler_lib.Completions]


def evaluate(
    model,
    samples: Sequence,
    tokenizer,
    *,
    options: PromptOptions | None = None,
    context: str = "student",
    max_new_tokens: int = 1024,
    do_sample: bool = False,
    temperature: float = 1.0,
    batch_size: int = 8,
    max_image_skips: int = 0,
    seed: int = 0,
    mesh: jax.sharding.Mesh | None = None,
    sampler_layout: str = "replicated",
    prompt_buckets: Sequence[int] | None = None,
    cache_dtype: str = "bfloat16",
    stream_fn: StreamFn = engine_lib.stream,
    log: Callable[[str], None] | None = None,
) -> EvalResult:
    """Sample a completion for every sample in `context` and score its extracted answer.

    model: an nnx Bagel (e.g. the trainer's live student: `nnx.merge(graphdef, params, rest)`).
    samples: `opsd_jax.data.pipeline.Sample`s (see `load_eval_samples`).
    tokenizer: a `BagelTokenizer` (encode, decode, special_tokens(), vocab_length).
    options: the prompt options of the run (system prompt, VT toggles, noise_vt, ...);
      None = the defaults (configs/common.py).
    do_sample=False is greedy; otherwise temperature sampling, each token of a sample drawn
      from `fold_in(fold_in(fold_in(key(seed), round), its index), step)`, so its random draws
      do not depend on `batch_size`; the logits can, in the last bits (the matmul kernels are
      chosen by shape), so in bfloat16 a completion can differ between batch sizes
      (opsd_jax/sampling/engine.py).
    batch_size: the engine's slots (opsd_jax/sampling/engine.py): every prompt streams through
      them, a finished row's slot taken by the next prompt, so no row waits for a longer one.
    mesh: sample on a decode copy of the model over its devices
      (opsd_jax/sampling/decode_copy.py: compute dtype, `sampler_layout`; made once here, freed
      at the end). Without a mesh the model samples as it is.
    prompt_buckets: prompt lengths round up to one of these (default: powers of two).
    stream_fn: `opsd_jax.sampling.engine.stream` or a drop-in (tests script outputs).
    log: called with a progress line every `batch_size` finished samples (e.g. `print`).

    Prompts are packed as slots free up (a group's lengths rounded up to the buckets), so the
    engine compiles once per bucket and never holds more than its slots' images.
    """
    if context not in CONTEXTS:
        raise ValueError(
            f"context={context!r}: allowed values are {', '.join(map(repr, CONTEXTS))}"
        )
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not samples:
        raise ValueError("evaluate(): no samples")
    options = run_config.prompt_options({}) if options is None else options
    special = tokenizer.special_tokens()

    def pack_rows(rows):
        chosen = [samples[i] for i in rows]
        return build_context_prompt_pack(
            chosen, tokenizer.encode, options, special, context, buckets=prompt_buckets
        )

    records: list[dict[str, Any] | None] = [None] * len(samples)
    finished: list[dict[str, Any]] = []  # in the order rows finish, for the progress line
    start = time.perf_counter()

    def on_done(index: int, completions: sampler_lib.Completions) -> None:
        records[index] = _record(samples[index], completions, index, tokenizer)
        finished.append(records[index])
        if log is not None and (len(finished) % batch_size == 0 or len(finished) == len(samples)):
            accuracy = np.mean([r["correct"] for r in finished])
            log(
                f"eval [{context}] {len(finished)}/{len(samples)} samples, running accuracy "
                f"{accuracy:.1%}, {time.perf_counter() - start:.1f}s"
            )

    sampled = decode_model(model, mesh, sampler_layout)
    try:
        stream_fn(
            sampled,
            engine_lib.Prompts(len(samples), pack_rows),
            jax.random.key(seed),
            pool_size=batch_size,
            row_ids=np.arange(len(samples)),
            on_done=on_done,
            **engine_lib.settings_for(
                tokenizer, max_new_tokens, do_sample, temperature, max_image_skips, cache_dtype
            ),
            prompt_buckets=prompt_buckets,
        )
    finally:
        if isinstance(sampled, decode_copy.DecodeCopy):
            sampled.delete()
    settings = {
        "context": context,
        "noise_vt": options.noise_vt,
        "max_new_tokens": max_new_tokens,
        "do_sample": do_sample,
        "temperature": temperature if do_sample else None,
        "batch_size": batch_size,
        "max_image_skips": max_image_skips,
        "seed": seed,
    }
    return EvalResult(records, summarize(records, settings))


def _record(sample, completions: sampler_lib.Completions, row: int, tokenizer) -> dict[str, Any]:
    """One sample's record: its completion decoded, the answer extracted and scored."""
    text = tokenizer.decode(completions.row(row))
    extracted = extract_answer(text)
    return {
        "pid": sample.pid,
        "dataset": sample.dataset,
        "question": sample.question,
        "reference": sample.answer,
        "generation": text,
        "extracted": extracted,
        "correct": is_correct(extracted, sample.answer),
        "completion_length": int(completions.lengths[row]),
        "finished": bool(completions.finished[row]),
        "has_answer_tag": has_answer_tag(text),
    }


def decode_model(model, mesh: jax.sharding.Mesh | None, sampler_layout: str):
    """What the sampler runs on: on a mesh, a compute-dtype copy of the model in the decode
    layout (no per-token weight gathers; free it with `.delete()`), else the model itself."""
    if mesh is None or model is None:
        return model
    graphdef, state = nnx.split(model)
    return decode_copy.make_decode_copy(
        graphdef,
        state,
        layout=sampler_layout,
        mesh=mesh,
        dtype=model.language_model.compute_dtype,
        model_config=getattr(model, "config", None),
    )


def answer(
    model,
    tokenizer,
    image,
    question: str,
    *,
    options: PromptOptions | None = None,
    image_transform=None,
    max_new_tokens: int = 1024,
    do_sample: bool = False,
    temperature: float = 1.0,
    max_image_skips: int = 0,
    seed: int = 0,
    mesh: jax.sharding.Mesh | None = None,
    cache_dtype: str = "bfloat16",
    sampler_layout: str = "replicated",
) -> tuple[str, sampler_lib.Completions]:
    """A completion for one PIL image and a question, as the student sees them at training and
    test time ([system?, image, question]): the text (special tokens kept, as in evaluation
    records) and the sampler's output. `image_transform`: an ImageTransform, a preset name or a
    dict of its fields (default: BAGEL's chat transform, 980 / 378). On a mesh it samples from a
    decode copy in `sampler_layout`, as `evaluate` does."""
    from opsd_jax.data.data_config import image_transform_from
    from opsd_jax.data.image_transform import ImageTransform, prepare_vit_image
    from opsd_jax.data.pipeline import Sample

    transform = ImageTransform.vit_chat() if image_transform is None else image_transform
    # Patches and position ids for this model's ViT (its patch size and position grid).
    vit = prepare_vit_image(
        image,
        image_transform_from(transform),
        patch_size=model.config.vit.patch_size,
        max_patches_per_side=model.config.vit_max_num_patch_per_side,
    )
    sample = Sample(
        pid="prompt",
        dataset="",
        question=question,
        answer="",
        problem_image=vit,
        vt_images=[],
        thoughts=[],
        full_text_only_thought=None,
    )
    special = tokenizer.special_tokens()
    prompt_pack = build_prompt_pack(
        [sample],
        tokenizer.encode,
        run_config.prompt_options({}) if options is None else options,
        special,
    )
    sampled = decode_model(model, mesh, sampler_layout)
    try:
        completions = engine_lib.stream(
            sampled,
            prompt_pack,
            jax.random.key(seed),
            pool_size=1,
            **engine_lib.settings_for(
                tokenizer, max_new_tokens, do_sample, temperature, max_image_skips, cache_dtype
            ),
        )
    finally:
        if sampled is not model:
            sampled.delete()
    return tokenizer.decode(completions.row(0)), completions


def load_eval_samples(
    data_config,
    split: str = "eval",
    max_per_dataset: int | None = None,
    log: Callable[[str], None] | None = None,
) -> list:
    """Every usable sample of `split` (default: the held-out split), dataset after dataset.

    data_config: an `opsd_jax.data.data_config.DataConfig`. `max_per_dataset` caps the rows read
    from each dataset (the first ones in file order; rows the pipeline skips as bad are not
    replaced). Every process reads all of them (evaluation is not sharded by host).
    """
    from opsd_jax.data.pipeline import make_iterator  # deferred: grain is only needed here

    if max_per_dataset is not None:
        if max_per_dataset < 1:
            raise ValueError(f"max_per_dataset must be >= 1, got {max_per_dataset}")
        specs = tuple(
            dataclasses.replace(
                spec,
                num_used_data=max_per_dataset
                if spec.num_used_data == -1
                else min(spec.num_used_data, max_per_dataset),
            )
            for spec in data_config.datasets
        )
        data_config = dataclasses.replace(data_config, datasets=specs)
    iterator = make_iterator(data_config, split, process_index=0, process_count=1)
    samples = list(iterator)
    skipped = {reason: n for reason, n in iterator.skipped.items() if n}
    if log is not None:
        counts = collections.Counter(s.dataset for s in samples)
        log(
            f"{len(samples)} {split} samples: {dict(counts)}"
            + (f"; skipped rows: {skipped}" if skipped else "")
        )
    if not samples:
        raise ValueError(
            f"no usable samples in split {split!r} of "
            f"{[d.name for d in data_config.datasets]} (skipped: {skipped})"
        )
    return samples


# ----------------------------------------------------------------------------------------------
# Output files
# ----------------------------------------------------------------------------------------------


def write_generations_jsonl(records: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> None:
    """One JSON object per sample (the `EvalResult.records` fields)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def write_summary_json(summary: Mapping[str, Any], path: str | os.PathLike) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, ensure_ascii=False)
        f.write("\n")


def markdown_table(summary: Mapping[str, Any]) -> str:
    """The summary as a Markdown table: one line per dataset, then the overall line."""
    lines = [
        "| dataset | samples | accuracy | answer tag | finished | mean length |",
        "|---|---:|---:|---:|---:|---:|",
    ]

    def line(name, m):
        return (
            f"| {name} | {m['num_samples']} | {m['accuracy']:.1%} | "
            f"{m['answer_tag_rate']:.1%} | {m['finished_rate']:.1%} | "
            f"{m['mean_completion_length']:.1f} |"
        )

    for name, metrics in summary["datasets"].items():
        lines.append(line(name, metrics))
    lines.append(line("**overall**", summary["overall"]))
    return "\n".join(lines) + "\n"


def write_markdown_table(summary: Mapping[str, Any], path: str | os.PathLike) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(markdown_table(summary))


def save_results(result: EvalResult, out_dir: str | os.PathLike, name: str = "eval"):
    """`<name>_generations.jsonl`, `<name>_summary.json`, `<name>_table.md` under out_dir."""
    paths = {
        "generations": os.path.join(out_dir, f"{name}_generations.jsonl"),
        "summary": os.path.join(out_dir, f"{name}_summary.json"),
        "table": os.path.join(out_dir, f"{name}_table.md"),
    }
    write_generations_jsonl(result.records, paths["generations"])
    write_summary_json(result.summary, paths["summary"])
    write_markdown_table(result.summary, paths["table"])
    return paths

"""K_gen: how much the privileged visual thought moves a frozen model's next-token distribution.

What: for every sample, the reference solution (`reference_completion`: the text-only thought and
the answer, in the completion format `<think>...</think><answer>...</answer>`) is scored
teacher-forced in two contexts, the teacher's (with the VT images) and the student's (without);
at every completion position we take the full-vocabulary KL(teacher ‖ student) in float32, and
K_gen is its mean over tokens. Run once more with `noise_vt=True` (PromptOptions) it gives the
control: how much any extra image moves the model, whatever its content. A K_gen well above the
noise control says the VT carries information the student lacks, i.e. there is something to
distil.

The verdict (`verdict`) is the PyTorch Visual-OPSD project's GO/NO-GO gate (its
scripts/visual_opsd/kl_diagnostic.py): GO when the answer-span KL, the per-sample mean KL over
the answer's tokens (`<answer>...</answer>` and the closing `<|im_end|>`) averaged over samples,
is above 0.05 nats; "VT context does not change predictions" otherwise. There the two contexts
score different thoughts aligned from the end, so only the answer span compares like with
like; here both score the same reference, and the answer span is its last tokens.

How: `opsd_packs.build_training_packs` gives student and teacher packs whose loss entries align
one to one (same sample, same completion index); the model runs once on each, and the logits
are taken at the loss rows in chunks of entries (`chunk_size`), so at most
[rows, chunk_size, vocab] float32 values exist at once, never [rows, entries, vocab]. Logits
at or past the tokenizer length (padding rows of the embedding table) are left out, as in the
sampler: the distributions are over the real ids.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.pack import Pack
from opsd_jax import run_config
from opsd_jax.data.opsd_packs import PromptOptions, build_training_packs
from opsd_jax.data.pipeline import reference_completion
from opsd_jax.parallel import distributed
from opsd_jax.parallel import mesh as mesh_lib


def kl_from_logits(
    teacher_logits: jax.Array, student_logits: jax.Array, vocab_limit: int | None = None
) -> jax.Array:
    """KL(softmax(teacher) ‖ softmax(student)) over the last axis, in float32: [..., V] -> [...]."""
    teacher = teacher_logits[..., :vocab_limit].astype(jnp.float32)
    student = student_logits[..., :vocab_limit].astype(jnp.float32)
    log_q = jax.nn.log_softmax(teacher, axis=-1)
    log_p = jax.nn.log_softmax(student, axis=-1)
    return jnp.sum(jnp.exp(log_q) * (log_q - log_p), axis=-1)


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _entry_kl(graphdef, params, student: Pack, teacher: Pack, vocab_limit: int, chunk: int):
    model = nnx.merge(graphdef, params)
    student_hidden = model(student)
    teacher_hidden = model(teacher)
    rows, entries = student.loss_rows.shape
    num_chunks = entries // chunk

    def by_chunk(x):  # [R, C] -> [C / chunk, R, chunk]
        return x.reshape(rows, num_chunks, chunk).transpose(1, 0, 2)

    def chunk_kl(chunk_rows):
        student_rows, teacher_rows = chunk_rows
        return kl_from_logits(
            model.logits_at(teacher_hidden, teacher_rows),
            model.logits_at(student_hidden, student_rows),
            vocab_limit,
        )

    kl = jax.lax.map(chunk_kl, (by_chunk(student.loss_rows), by_chunk(teacher.loss_rows)))
    kl = kl.transpose(1, 0, 2).reshape(rows, entries)
    return jnp.where(student.loss_mask, kl, 0.0)


def entry_kl(
    model, student: Pack, teacher: Pack, vocab_limit: int | None = None, chunk_size: int = 64
) -> np.ndarray:
    """KL(teacher ‖ student) at every loss entry of two aligned packs: [R, C] float32, 0 where
    the entry is padding. `vocab_limit` None keeps every logit row."""
    if tuple(student.loss_rows.shape) != tuple(teacher.loss_rows.shape):
        raise ValueError(
            f"student and teacher loss entries differ: {student.loss_rows.shape} vs "
            f"{teacher.loss_rows.shape}; build them with build_training_packs"
        )
    entries = student.loss_rows.shape[1]
    chunk = max(1, min(chunk_size, entries))
    while entries % chunk:  # entries are a power of two (bucketed); this is for hand-made packs
        chunk -= 1
    graphdef, params = nnx.split(model)
    vocab = model.config.llm.vocab_size if vocab_limit is None else int(vocab_limit)
    return np.asarray(_entry_kl(graphdef, params, student, teacher, vocab, chunk))


@dataclasses.dataclass(frozen=True)
class KLResult:
    """Per-sample and per-token K_gen of one context setting.

    records: per sample (input order): pid, dataset, num_tokens, mean_kl, sum_kl,
      answer_tokens, answer_mean_kl, truncated (the reference was cut to fit
      max_forward_tokens: its answer span is not measured, NaN).
    token_kl: {dataset: float32 array of every completion token's KL}.
    summary: {"overall": stats, "datasets": {name: stats}, "num_dropped": n,
      "num_truncated": n}; stats =
      num_samples, num_tokens, mean (token-weighted K_gen), std (over tokens), sample_mean,
      sample_std (over per-sample means).
    """

    records: list[dict[str, Any]]
    token_kl: dict[str, np.ndarray]
    summary: dict[str, Any]


GO_THRESHOLD = 0.05  # nats: the PyTorch project's gate on the answer-span KL


def _stats(records: Sequence[Mapping[str, Any]], tokens: np.ndarray) -> dict[str, float]:
    tokens = tokens.astype(np.float64)
    per_sample = np.array([r["mean_kl"] for r in records], np.float64)
    answers = np.array([r["answer_mean_kl"] for r in records], np.float64)
    answers = answers[~np.isnan(answers)]
    return {
        "num_samples": len(records),
        "num_tokens": int(tokens.size),
        "mean": float(tokens.mean()) if tokens.size else float("nan"),
        "std": float(tokens.std()) if tokens.size else float("nan"),
        "sample_mean": float(per_sample.mean()) if per_sample.size else float("nan"),
        "sample_std": float(per_sample.std()) if per_sample.size else float("nan"),
        "answer_span_mean": float(answers.mean()) if answers.size else float("nan"),
    }


def json_ready(value: Any) -> Any:
    """`value` (a summary, a record) with every non-finite float, a statistic of no values,
    replaced by None: JSON has no NaN (json.dump writes a bare `NaN`, which strict JSON
    parsers reject)."""
    if isinstance(value, Mapping):
        return {key: json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(item) for item in value]
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


def verdict(vt_summary: Mapping[str, Any], noise_summary: Mapping[str, Any] | None = None):
    """("GO" or "NO-GO", one line saying why): the PyTorch project's gate (module docstring) on
    the VT run's answer-span KL, with the noise-VT control next to it when there is one."""
    answer = vt_summary["overall"]["answer_span_mean"]
    go = bool(answer > GO_THRESHOLD)
    why = (
        f"answer-span KL(teacher with VT || student) {answer:.4f} nats "
        f"{'>' if go else '<='} {GO_THRESHOLD} (the PyTorch Visual-OPSD gate, "
        f"scripts/visual_opsd/kl_diagnostic.py): "
        + (
            "proceed with Visual-OPSD training"
            if go
            else "the VT context does not change the answer's predictions"
        )
    )
    if noise_summary is not None:
        noise = noise_summary["overall"]["answer_span_mean"]
        why += f"; noise-VT control {noise:.4f} nats"
        if go and not answer > noise:
            why += " (as high: what moves the answer is any extra image, not the VT's content)"
    return ("GO" if go else "NO-GO"), why


def kl_diagnostic(
    model,
    samples: Sequence,
    tokenizer,
    *,
    options: PromptOptions | None = None,
    batch_size: int = 8,
    max_forward_tokens: int,
    chunk_size: int = 64,
    completion_fn: Callable[[Any], str] = reference_completion,
    mesh: jax.sharding.Mesh | None = None,
    log: Callable[[str], None] | None = None,
) -> KLResult:
    """K_gen of `model` on `samples`: KL(teacher-with-VT ‖ student-without-VT) per reference token.

    Samples are scored `batch_size` at a time, one per row (the last batch padded by repeating
    its final sample, padding dropped). A sample whose teacher context alone exceeds
    `max_forward_tokens` is dropped (counted in `num_dropped`); a longer reference is truncated
    to fit, as in training (counted in `num_truncated`): its last entries are then thought, not
    the answer, so its answer span is left out of the gate. `completion_fn` maps a sample to the
    completion text scored.
    `mesh`: run under it, rows sharded over its batch axes when `batch_size` divides.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not samples:
        raise ValueError("kl_diagnostic(): no samples")
    options = run_config.prompt_options({}) if options is None else options
    special = tokenizer.special_tokens()
    records: list[dict[str, Any]] = []
    tokens_by_dataset: dict[str, list[np.ndarray]] = collections.defaultdict(list)
    dropped = truncated = 0
    start = time.perf_counter()
    for first in range(0, len(samples), batch_size):
        batch = list(samples[first : first + batch_size])
        real = len(batch)
        batch += [batch[-1]] * (batch_size - real)
        completions = [tokenizer.encode(completion_fn(s)) for s in batch]
        # The answer span: the reference's `<answer>...</answer>` tokens + the closing EOS entry.
        answer_entries = [
            len(tokenizer.encode(f"<answer>{s.answer}</answer>")) + 1
            if completion_fn is reference_completion
            else 0
            for s in batch
        ]
        try:
            packs = build_training_packs(
                batch,
                completions,
                tokenizer.encode,
                options,
                special,
                num_rows=batch_size,
                max_forward_tokens=max_forward_tokens,
            )
        except ValueError as e:
            if "no sample fits" not in str(e):
                raise
            dropped += real  # every context in the batch is longer than max_forward_tokens
            continue
        if mesh is None:
            kl = entry_kl(model, packs.student, packs.teacher, tokenizer.vocab_length, chunk_size)
        else:
            with mesh_lib.use_mesh(mesh):
                student, teacher = (
                    distributed.put_rows(p, mesh, rows_are_global=True)
                    for p in (packs.student, packs.teacher)
                )
                kl = entry_kl(model, student, teacher, tokenizer.vocab_length, chunk_size)
        mask = np.asarray(packs.student.loss_mask)
        owner = np.asarray(packs.student.loss_sample)  # index into packs.kept
        dropped += sum(1 for i in range(real) if i not in packs.kept)
        for position, index in enumerate(packs.kept):
            if index >= real:
                continue  # padding
            values = kl[mask & (owner == position)].astype(np.float32)
            sample = batch[index]
            cut = len(packs.completions[position]) < len(completions[index])
            truncated += cut
            measured = answer_entries[index] and not cut
            answer = values[-answer_entries[index] :] if measured else values[:0]
            records.append(
                {
                    "pid": sample.pid,
                    "dataset": sample.dataset,
                    "num_tokens": int(values.size),
                    "mean_kl": float(values.mean()) if values.size else float("nan"),
                    "sum_kl": float(values.sum()),
                    "answer_tokens": int(answer.size),
                    "answer_mean_kl": float(answer.mean()) if answer.size else float("nan"),
                    "truncated": bool(cut),
                }
            )
            tokens_by_dataset[sample.dataset].append(values)
        if log is not None:
            log(
                f"K_gen [{'noise VT' if options.noise_vt else 'VT'}] "
                f"{min(first + batch_size, len(samples))}/{len(samples)} samples, "
                f"{time.perf_counter() - start:.1f}s"
            )
    token_kl = {name: np.concatenate(parts) for name, parts in tokens_by_dataset.items()}
    datasets = {
        name: _stats([r for r in records if r["dataset"] == name], values)
        for name, values in token_kl.items()
    }
    all_tokens = np.concatenate(list(token_kl.values())) if token_kl else np.zeros(0, np.float32)
    summary = {
        "overall": _stats(records, all_tokens),
        "datasets": datasets,
        "num_dropped": dropped,
        "num_truncated": truncated,
    }
    return KLResult(records, token_kl, summary)


def markdown_table(results: Mapping[str, KLResult]) -> str:
    """Side-by-side K_gen per dataset for several settings (e.g. {"VT": ..., "noise VT": ...})."""
    names = list(results)
    datasets = []
    for result in results.values():
        datasets += [d for d in result.summary["datasets"] if d not in datasets]
    header = (
        "| dataset | samples | tokens | "
        + " | ".join(f"K_gen {n} (mean ± std) | per-sample {n}" for n in names)
        + " |"
    )
    lines = [header, "|---|---:|---:|" + "---:|---:|" * len(names)]

    def line(label, stats_list):
        first = stats_list[0]
        cells = [
            f"{s['mean']:.4f} ± {s['std']:.4f} | {s['sample_mean']:.4f} ± {s['sample_std']:.4f}"
            for s in stats_list
        ]
        return (
            f"| {label} | {first['num_samples']} | {first['num_tokens']} | "
            + " | ".join(cells)
            + " |"
        )

    for name in datasets:
        if all(name in r.summary["datasets"] for r in results.values()):
            lines.append(line(name, [r.summary["datasets"][name] for r in results.values()]))
    lines.append(line("**overall**", [r.summary["overall"] for r in results.values()]))
    return "\n".join(lines) + "\n"


def save_histogram(results: Mapping[str, KLResult], path: str) -> None:
    """A PNG histogram of per-token KL for each setting, overlaid (log-scaled counts)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    arrays = {
        name: np.concatenate(list(r.token_kl.values())) if r.token_kl else np.zeros(0)
        for name, r in results.items()
    }
    everything = np.concatenate([a for a in arrays.values()] + [np.zeros(1)])
    high = max(float(np.percentile(everything, 99.5)), 1e-6)
    bins = np.linspace(0.0, high, 60)
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name, values in arrays.items():
        mean = float(values.mean()) if values.size else float("nan")
        axis.hist(
            np.clip(values, 0.0, high),
            bins=bins,
            alpha=0.55,
            label=f"{name}: mean {mean:.4f} ({values.size} tokens)",
        )
    axis.set_yscale("log")
    axis.set_xlabel("per-token KL(teacher ‖ student), nats (top 0.5% clipped into the last bin)")
    axis.set_ylabel("tokens")
    axis.set_title("K_gen: privileged VT vs noise control")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)

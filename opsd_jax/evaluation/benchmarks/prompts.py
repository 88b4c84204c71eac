"""A benchmark row's prompt: its images, then one text, as the harness lays them out for BAGEL
models (every image before the text).

The text of a multiple-choice row, as VLMEvalKit builds it: `Hint: <hint>` (when the row has
one), `Question: <question>`, `Options:` with one `<letter>. <text>` line per option the row
has, and an instruction to pick one of them; a row without options gets the hint and question
only. A plain row's text is its question; a CV-Bench row's is its own `prompt` column.

The system prompt is the evaluated run's (its `system_prompt`, the trainer's default wording
when empty): the model answers in the format it was trained to use. The harness instead adds
ThinkMorph's thinking-mode instruction; pass that wording as the run's system prompt to match
it exactly.
"""

from __future__ import annotations

from opsd_jax.data.packing import Image, Text
from opsd_jax.evaluation.benchmarks.registry import Dataset
from opsd_jax.evaluation.benchmarks.tsv import BenchmarkRow

# The last line, trailing space included, as the harness writes it.
CHOOSE = "Please select the correct answer from the options above. "


def question_text(row: BenchmarkRow, dataset: Dataset) -> str:
    """The text part of the row's prompt."""
    if dataset.prompt == "own_prompt":
        return row.extra.get("prompt") or row.question
    if dataset.prompt == "plain":
        return row.question
    lines = [f"Hint: {row.hint}"] if row.hint else []
    lines.append(f"Question: {row.question}")
    if row.options:
        lines.append("Options:")
        lines += [f"{letter}. {text}" for letter, text in row.options.items()]
        lines.append(CHOOSE)
    return "\n".join(lines) + "\n"


def prompt_items(vit_images, text: str, encode, options) -> list:
    """[system?] [image ...] [text]: the sampler's items for one row (`vit_images`: each image's
    ViT inputs, from opsd_jax/data/image_transform.prepare_vit_image)."""
    items = [Text(encode(options.system_prompt))] if options.use_system_prompt else []
    items += [Image(v.patches, v.position_ids) for v in vit_images]
    items.append(Text(encode(text + options.instruction_suffix)))
    return items

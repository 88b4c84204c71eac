"""A benchmark row's prompt, as the ThinkMorph harness builds it for BAGEL models.

1. The dataset's message (VLMEvalKit's `build_prompt`): the row's images, then one text. The
   text of a multiple-choice row: `Hint: <hint>` (when the row has one), `Question: <question>`,
   `Options:` with one `<letter>. <text>` line per option the row has, and an instruction to
   pick one of them; a row without options gets the hint and question only. A plain row's text
   is its question; a CV-Bench row's is its own `prompt` column. VSP's question places its
   images itself: `<IMAGE-n>` (the n-th image) and `<TEST-IMAGE>` (the last) split the text,
   each tag replaced by its image, and an image no tag names is left out.
2. The model's input (the harness's ThinkMorph class): every image of the message first, in its
   order, then one text: the message's parts joined by single spaces, each image as the
   placeholder `<img><|image_k|></img>` (k from 1), each text as it is.

The system prompt is the evaluated run's (its `system_prompt`, the trainer's default wording
when empty): the model answers in the format it was trained to use. The harness instead gives
ThinkMorph's thinking-mode instruction (as a text before the images, where ours goes too); pass
that wording as the run's system prompt to match it exactly.
"""

from __future__ import annotations

import re

from opsd_jax.data.packing import Image, Text
from opsd_jax.evaluation.benchmarks.registry import Dataset
from opsd_jax.evaluation.benchmarks.tsv import BenchmarkRow

# The last line, trailing space included, as the harness writes it.
CHOOSE = "Please select the correct answer from the options above. "
# VSP's image tags: the n-th image (from 1), or the last one.
_IMAGE_TAG = re.compile(r"<IMAGE-(\d+)>|<TEST-IMAGE>")


def question_text(row: BenchmarkRow, dataset: Dataset) -> str:
    """The text part of the row's message."""
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


def message(row: BenchmarkRow, dataset: Dataset) -> list[int | str]:
    """The dataset's message: image numbers (into `row.images_b64`) and texts, in order."""
    text = question_text(row, dataset)
    count = len(row.images_b64)
    if not (dataset.image_tags and _IMAGE_TAG.search(text)):
        return [*range(count), text]
    parts: list[int | str] = []
    position = 0
    for tag in _IMAGE_TAG.finditer(text):
        if text[position : tag.start()]:
            parts.append(text[position : tag.start()])
        image = int(tag.group(1)) - 1 if tag.group(1) else count - 1
        if 0 <= image < count:
            parts.append(image)
        position = tag.end()
    if text[position:]:
        parts.append(text[position:])
    return parts


def model_input(parts: list[int | str]) -> tuple[list[int], str]:
    """(the images in the order the model sees them, its one text) for a message."""
    images = [p for p in parts if isinstance(p, int)]
    words, k = [], 0
    for part in parts:
        if isinstance(part, int):
            k += 1
            words.append(f"<img><|image_{k}|></img>")
        else:
            words.append(part)
    return images, " ".join(words)


def prompt_items(vit_images, text: str, encode, options) -> list:
    """[system?] [image ...] [text]: the sampler's items for one row (`vit_images`: each image's
    ViT inputs, from opsd_jax/data/image_transform.prepare_vit_image)."""
    items = [Text(encode(options.system_prompt))] if options.use_system_prompt else []
    items += [Image(v.patches, v.position_ids) for v in vit_images]
    items.append(Text(encode(text + options.instruction_suffix)))
    return items

"""Host work of one Visual-OPSD training step, measured on this machine (CPU, Python / numpy).

What a step of train.py does outside the jitted programs, for the step's samples
(samples_per_micro_batch x gradient_accumulation_steps, one process holding them all):

* image decode: `sources.decode_row` on rows whose problem and VT images are PNG bytes;
* images: `pipeline.prepare_sample`, the ViT transform of every image (`prepare_vit_image`:
  resize to the recipe's image transform, normalize, patchify, position ids);
* prompt packs: `build_prompt_pack` of the step's samples at `sample_prompt_buckets`;
* pack memory: `PackMemory.make`, the next step's zero-filled pack arrays that train.py makes
  on a background thread while the step before runs (opsd_jax/training/pack_memory.py);
* training packs: train.py's pack phase, `OpsdBatches.host_pack` (`OpsdBatches.pack` up to its
  device put: `build_training_packs` of every micro-batch at the recipe's fixed pack shapes,
  written into the prepared memory, stacked [micro, rows, ...]), on completions of
  `sample_max_new_tokens` random ids (the longest a rollout makes). Also timed into new
  arrays, as before pack memory (shown, not added).

Why: bench/scale.py adds the training packs to its projection of a step's time, which
otherwise counts device programs only (the rest runs while device work does). Each part is timed on one thread, as it runs (the decode and the ViT
transform run in grain's read threads, which may overlap device work: an upper bound there).
Images are synthetic 1024x768 RGB (smooth gradients plus noise, so PNG compresses as a picture
does); text is tokenized by a toy Qwen2-format BPE tokenizer built offline (opsd_jax/toy/model.py),
not ThinkMorph's, so text segments have somewhat more ids than with the real vocabulary.
Not included: the host-to-device copies of the prompt and training packs (no GPU here), the
sampler's decode of text, logging.

    python bench/host_work.py [--repeats 3] [--config configs/thinkmorph_7b.py]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

IMAGE_SIZE = (1024, 768)  # width, height: a typical ThinkMorph picture, above the 980 px max side
# The ViT transform is the same per sample, so it is timed on this many samples and scaled to
# the step's count; packing is timed at full size (its fixed-shape arrays do not scale).
IMAGE_SAMPLES = 4


def _png(seed: int) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    width, height = IMAGE_SIZE
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = rng.uniform(0, 6.28, 3)
    channels = [127 + 100 * np.sin(x / (90 + 40 * c) + y / 130 + phase[c]) for c in range(3)]
    pixels = np.stack(channels, -1) + rng.normal(0, 6, (height, width, 3))
    buffer = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _record(index: int, rounds: int) -> dict:
    """A ThinkMorph row (sources.py's column names) with `rounds` VT images."""
    from opsd_jax.toy import model as toy_model

    words = " ".join(toy_model.builtin_corpus()[4 + index : 8 + index])
    record = {
        "pid": f"synthetic-{index}",
        "question": f"Look at the picture. {words} Which option is correct? A, B, C or D?",
        "answer": "B",
        "full_text_only_thought": words,
        "problem_image_0": {"bytes": _png(2 * index)},
        "resoning_thought_0": words,
    }
    for k in range(rounds):
        record[f"reasoning_image_{k}"] = {"bytes": _png(2 * index + 1 + k)}
    return record


def _timed(fn, repeats: int):
    """(median seconds of `repeats` calls of fn, fn's last result)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def measure(recipe, repeats: int = 3) -> dict[str, float]:
    """Seconds of host work per training step of `recipe` (a run config), median of `repeats`:
    "image decode", "images", "prompt packs", "pack memory", "training packs" and their
    "total"; and "training packs, new arrays" (not in the total: packing without pack memory).
    Imports the heavy modules here, so `import host_work` stays cheap (bench/scale.py)."""
    import numpy as np

    from opsd_jax import run_config
    from opsd_jax.data import pack_shapes, pipeline, sources
    from opsd_jax.data.data_config import DataConfig
    from opsd_jax.data.opsd_packs import build_prompt_pack
    from opsd_jax.io.tokenizer import BagelTokenizer, add_special_tokens
    from opsd_jax.toy import model as toy_model
    from opsd_jax.training.step_batches import OpsdBatches

    per_micro, accum = recipe.samples_per_micro_batch, recipe.gradient_accumulation_steps
    step_samples = per_micro * accum
    rounds = 1  # VT images per released ThinkMorph row
    hf_tokenizer, _, _ = toy_model.train_tokenizer(toy_model.builtin_corpus(), 1000)
    tokenizer = BagelTokenizer(hf_tokenizer, add_special_tokens(hf_tokenizer))
    special, encode = tokenizer.special_tokens(), tokenizer.encode
    options = run_config.prompt_options(recipe)
    fields = run_config.data_fields(recipe)
    data = DataConfig.from_dict(dict(fields, datasets=[dict(name="synthetic", path="-")]))
    records = [_record(i, rounds) for i in range(IMAGE_SAMPLES)]
    limit = data.max_reference_rounds

    def decode():
        return [sources.decode_row(r, "synthetic", max_reference_rounds=limit) for r in records]

    decode_s, raws = _timed(decode, repeats)
    images_s, prepared = _timed(lambda: [pipeline.prepare_sample(r, data) for r in raws], repeats)
    # The step's samples: the prepared ones repeated (packing reads them, never changes them).
    samples = [prepared[i % IMAGE_SAMPLES] for i in range(step_samples)]

    def prompt_pack():
        buckets = recipe.sample_prompt_buckets
        return build_prompt_pack(samples, encode, options, special, buckets=buckets)

    prompt_s, _ = _timed(prompt_pack, repeats)
    # The longest completions a rollout makes, ids drawn below the special tokens.
    rng = np.random.default_rng(0)
    high = special.im_start - 1
    completions = [
        rng.integers(0, high, recipe.sample_max_new_tokens).tolist() for _ in range(step_samples)
    ]
    batches = OpsdBatches(
        recipe,
        pack_shapes.pack_shapes(recipe),
        encode,
        options,
        special,
        None,  # no mesh: the device put is left out (see `stack`)
        local_samples=per_micro,
        local_rows=recipe.rows_per_micro_batch,
        sample_offset=0,
    )
    # OpsdBatches.pack up to its device put (one length bucket in the recipe, so nothing is
    # packed twice); its device put is not timed: on one CPU device here it would be a new
    # 0.6 GB copy, not what the GPU's host-to-device copy costs. First into new arrays (no
    # memory prepared), then as train.py packs from its second step on: into the memory that
    # PackMemory made meanwhile on its thread (timed on its own here).
    new_arrays_s, _ = _timed(lambda: batches.host_pack(0, samples, completions), repeats)
    memory_s, _ = _timed(lambda: batches.memory.make(0), repeats)
    training = []
    for _ in range(repeats):
        batches.memory.prepare(0)
        batches.memory.wait()
        training.append(_timed(lambda: batches.host_pack(0, samples, completions), 1)[0])
    scale = step_samples / IMAGE_SAMPLES
    parts = {
        "image decode": decode_s * scale,
        "images": images_s * scale,
        "prompt packs": prompt_s,
        "pack memory": memory_s,
        "training packs": statistics.median(training),
    }
    return dict(parts, total=sum(parts.values()), **{"training packs, new arrays": new_arrays_s})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--config", default=os.path.join(root, "configs", "thinkmorph_7b.py"))
    args = parser.parse_args()
    from opsd_jax.run_config.command_line import load_config_file

    recipe = load_config_file(args.config)
    seconds = measure(recipe, args.repeats)
    step = recipe.samples_per_micro_batch * recipe.gradient_accumulation_steps
    new_arrays = seconds.pop("training packs, new arrays")
    parts = ", ".join(f"{name} {s:.3f} s" for name, s in seconds.items() if name != "total")
    print(
        f"host work per step (this machine, {len(os.sched_getaffinity(0))} cores): {parts}; "
        f"total {seconds['total']:.3f} s"
    )
    print(
        f"  training packs into new arrays (no pack memory): {new_arrays:.3f} s; on the step's "
        "path: the training packs only (pack memory is made on a thread while the step before "
        "runs; the rest runs while device work does)"
    )
    print(
        f"  median of {args.repeats}; {step} samples of {IMAGE_SIZE[0]}x{IMAGE_SIZE[1]} px, "
        f"1 problem + 1 VT image each; images measured on {IMAGE_SAMPLES} samples, scaled to "
        f"{step}; completions of {recipe.sample_max_new_tokens} tokens; toy tokenizer; "
        "not included: host-to-device copies of the packs, the sampler's text decode"
    )


if __name__ == "__main__":
    main()

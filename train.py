"""opsd-jax entry point: python train.py --config configs/<name>.py [--config.key=value ...]

The OPSD trainer is not built yet. Until it is, this runs the most complete job that exists: the
configured BAGEL model, sharded on the device mesh, does one jitted packed forward over
generated samples ([random image, question, answer] in BAGEL's layout: a bidirectional image
block, then causal text segments) and prints statistics of its logits at the answer rows.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx
from ml_collections import config_flags

from models.bagel import Bagel
from models.configs import BagelConfig
from opsd_jax import mesh as mesh_lib
from opsd_jax.data.image_transform import patchify, vit_position_ids
from opsd_jax.packing import Image, SpecialTokens, Text, pack_samples

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.")
flags.mark_flags_as_required(["config"])

_PRESETS = {"tiny": BagelConfig.tiny, "bagel_7b": BagelConfig.bagel_7b}


def generated_samples(rng: np.random.Generator, count: int, vocab_size: int, max_grid: int):
    """Random [image, question, answer] samples; the answer segment carries the loss."""
    samples = []
    for _ in range(count):
        grid_h, grid_w = rng.integers(1, max_grid + 1, 2)
        pixels = rng.uniform(-1, 1, (14 * grid_h, 14 * grid_w, 3)).astype(np.float32)
        image = Image(patchify(pixels), vit_position_ids(int(grid_h), int(grid_w)))
        question = rng.integers(1, vocab_size - 4, rng.integers(4, 24)).tolist()
        answer = rng.integers(1, vocab_size - 4, rng.integers(2, 16)).tolist()
        samples.append([image, Text(question), Text(answer, loss=True)])
    return samples


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # jax's backend probing is noise here
    config = _CONFIG.value
    if config.model_preset not in _PRESETS:
        raise ValueError(
            f"config.model_preset={config.model_preset!r}; allowed values: {sorted(_PRESETS)}"
        )
    model_config = _PRESETS[config.model_preset](
        llm=dict(
            compute_dtype=config.compute_dtype,
            attention_backend=config.attention_backend,
            remat=config.remat,
        )
    )
    mesh = mesh_lib.make_mesh(
        num_replicate=config.num_replicate,
        num_shard=None if config.num_shard == -1 else config.num_shard,
        num_tensor=config.num_tensor,
    )
    rows_per_step = mesh.shape["data"] * mesh.shape["fsdp"]
    if config.forward_rows % rows_per_step:
        raise ValueError(
            f"config.forward_rows={config.forward_rows} must be divisible by the mesh's "
            f"data x fsdp = {rows_per_step} (rows are sharded over them)"
        )
    print("train.py: the OPSD trainer is not built yet; running a packed forward pass instead.")
    print(f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} device(s)")

    t0 = time.perf_counter()
    model = mesh_lib.create_sharded_model(
        lambda: Bagel(model_config, rngs=nnx.Rngs(config.global_seed)), mesh
    )
    num_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"model {config.model_preset}: {num_params:,} parameters, "
          f"built in {time.perf_counter() - t0:.1f}s")  # fmt: skip

    vocab = model_config.llm.vocab_size
    # Structural ids: Qwen2.5's for the real vocabulary, the last four ids of a toy vocabulary.
    special = SpecialTokens() if vocab > 151653 else SpecialTokens(*range(vocab - 4, vocab))
    rng = np.random.default_rng(config.global_seed)
    samples = generated_samples(rng, 4 * config.forward_rows, vocab, max_grid=6)
    pack = pack_samples(
        samples, row_length=config.forward_tokens, num_rows=config.forward_rows, special=special
    )
    graphdef, state = nnx.split(model)

    @jax.jit
    def answer_logit_stats(state, pack):
        m = nnx.merge(graphdef, state)
        logits = m.logits_at(m(pack), pack.loss_rows).astype(jnp.float32)  # [R, C, V]
        valid = pack.loss_mask
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
        target_nll = -jnp.take_along_axis(log_probs, pack.loss_targets[..., None], -1)[..., 0]
        mean = lambda x: jnp.sum(jnp.where(valid, x, 0.0)) / valid.sum()  # noqa: E731
        return dict(
            logit_mean=mean(logits.mean(-1)),
            logit_std=mean(logits.std(-1)),
            entropy=mean(entropy),
            answer_nll=mean(target_nll),
        )

    with jax.set_mesh(mesh):
        device_pack = jax.tree.map(
            lambda x: jax.device_put(x, mesh_lib.batch_sharding(mesh, x.ndim)), pack
        )
        t0 = time.perf_counter()
        stats = jax.device_get(answer_logit_stats(state, device_pack))
        elapsed = time.perf_counter() - t0
    real = int((pack.segment_ids > 0).sum())
    print(f"forward: {pack.num_rows} rows x {pack.row_length} tokens, {len(samples)} samples "
          f"({real} real tokens, {int((pack.vit_slots >= 0).sum())} image patches, "
          f"{int(pack.loss_mask.sum())} answer tokens), compile + run {elapsed:.1f}s")  # fmt: skip
    print("answer-row logits: " + "  ".join(f"{k}={float(v):.4f}" for k, v in stats.items()))
    print(f"(a uniform prediction has entropy = nll = {np.log(vocab):.4f})")


if __name__ == "__main__":
    app.run(main)

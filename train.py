"""opsd-jax entry point: python train.py --config configs/<name>.py [--config.key=value ...]

The OPSD trainer is not built yet. Until it is, this runs the most complete job that exists: the
configured model, sharded on the device mesh, does a jitted forward over packed rows of
generated samples (causal text segments with bidirectional image-like blocks) and prints
statistics of its logits.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx
from ml_collections import config_flags

from models.configs import BagelConfig
from models.qwen2_mot import Qwen2MoT
from opsd_jax import mesh as mesh_lib

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.")
flags.mark_flags_as_required(["config"])

_PRESETS = {"tiny": BagelConfig.tiny, "bagel_7b": BagelConfig.bagel_7b}


def generated_rows(rng: np.random.Generator, rows: int, length: int, vocab_size: int):
    """Packed rows of random samples: text runs and image-like bidirectional blocks."""
    batch = {
        name: np.zeros((rows, length), np.int32)
        for name in ("tokens", "positions", "segment_ids", "k_start", "k_end")
    }
    for r in range(rows):
        t, segment = 0, 0
        while t < length - 4:
            segment += 1
            sample_end = min(length, t + int(rng.integers(16, max(17, length // 2))))
            start, position = t, 0
            while t < sample_end:
                n = min(sample_end - t, int(rng.integers(2, 24)))
                block = rng.random() < 0.3  # an image block: one position id, bidirectional
                sl = slice(t, t + n)
                batch["tokens"][r, sl] = rng.integers(1, vocab_size, n)
                batch["segment_ids"][r, sl] = segment
                batch["k_start"][r, sl] = start
                batch["k_end"][r, sl] = t + n if block else np.arange(t, t + n) + 1
                batch["positions"][r, sl] = position if block else position + np.arange(n)
                position += 1 if block else n
                t += n
    return batch


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
    print("train.py: the OPSD trainer is not built yet; running a forward pass instead.")
    print(f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} device(s)")

    llm_config = model_config.llm
    t0 = time.perf_counter()
    lm = mesh_lib.create_sharded_model(
        lambda: Qwen2MoT(llm_config, rngs=nnx.Rngs(config.global_seed)), mesh
    )
    num_params = sum(x.size for x in jax.tree.leaves(nnx.state(lm)))
    print(
        f"model {config.model_preset}: {num_params:,} LM parameters, "
        f"built in {time.perf_counter() - t0:.1f}s"
    )

    rng = np.random.default_rng(config.global_seed)
    batch = generated_rows(rng, config.forward_rows, config.forward_tokens, llm_config.vocab_size)
    graphdef, state = nnx.split(lm)

    @jax.jit
    def logit_stats(state, batch):
        model = nnx.merge(graphdef, state)
        hidden = model(
            model.embed(batch["tokens"]),
            positions=batch["positions"],
            segment_ids=batch["segment_ids"],
            k_start=batch["k_start"],
            k_end=batch["k_end"],
        )
        logits = model.logits(hidden).astype(jnp.float32)
        valid = (batch["segment_ids"] > 0)[..., None]
        count = valid.sum() * logits.shape[-1]
        mean = jnp.sum(jnp.where(valid, logits, 0.0)) / count
        std = jnp.sqrt(jnp.sum(jnp.where(valid, (logits - mean) ** 2, 0.0)) / count)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
        mean_entropy = jnp.sum(jnp.where(valid[..., 0], entropy, 0.0)) / valid.sum()
        return dict(
            mean=mean,
            std=std,
            min=jnp.min(jnp.where(valid, logits, jnp.inf)),
            max=jnp.max(jnp.where(valid, logits, -jnp.inf)),
            entropy=mean_entropy,
        )

    with jax.set_mesh(mesh):
        sharding = mesh_lib.batch_sharding(mesh)
        device_batch = {k: jax.device_put(v, sharding) for k, v in batch.items()}
        t0 = time.perf_counter()
        stats = jax.device_get(logit_stats(state, device_batch))
        elapsed = time.perf_counter() - t0
    real_tokens = int((batch["segment_ids"] > 0).sum())
    print(
        f"forward: {config.forward_rows} rows x {config.forward_tokens} tokens "
        f"({real_tokens} real, {int(batch['segment_ids'].max(axis=1).sum())} samples), "
        f"compile + run {elapsed:.1f}s"
    )
    print("logits: " + "  ".join(f"{k}={float(v):.4f}" for k, v in stats.items()))
    print(f"(uniform entropy over the vocabulary would be {np.log(llm_config.vocab_size):.4f})")


if __name__ == "__main__":
    app.run(main)

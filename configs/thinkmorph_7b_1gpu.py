"""The Visual-OPSD paper recipe on ThinkMorph-7B on one 80 GB GPU, with LoRA.

    python train.py --config configs/thinkmorph_7b_1gpu.py \
        --config.model_path=/path/to/ThinkMorph-7B --config.data_root=/path/to/ThinkMorph_data

Check first that it fits the GPU you rent (no GPU needed; about a minute a program):

    python train.py --config configs/thinkmorph_7b_1gpu.py --compile_only=h100:1

What is the paper's (configs/thinkmorph_7b.py): the data, the loss (generalized JSD, beta 0.5,
tau 1, teacher top-256, per-entry clip 0.05), the EMA teacher (decay 0.995), sampling (1024 new
tokens, temperature 1, one image skip), 16 samples an optimizer step, 1000 steps, warmup 200 and
the cosine schedule. What one GPU changes: the 16 samples are 16 micro-batches of one sample in
one row (gradient accumulation; on eight GPUs each device holds one row per micro-batch too, so a
micro-batch's activations are the same), prompt buckets capped at the longest trainable
prompt (below), and LoRA instead of full fine-tuning. Full fine-tuning
holds fp32 weights, AdamW moments, the fp32 EMA teacher and gradients of 8 B parameters, about
150 GB; here the base is held once in bf16 (about 16 GB), shared by the student, the EMA teacher
(the base with an EMA of the adapters) and the sampler, and the adapters with their moments and
EMA are about 2.6 GB.

The choices:

* rank 64, alpha 64 (scale 1), on every projection of the LM's und expert (q, k, v, o, gate,
  up, down: about 161 M parameters). On-policy distillation sends few bits per sample (one
  target distribution per sampled token over 16k samples), the regime where LoRA of moderate
  rank on every layer, MLPs included, matches full fine-tuning (Thinking Machines, "LoRA
  Without Regret", 2025: rank 32-64 suffices for RL-style objectives; attention-only LoRA
  underperforms). The gen expert sees no token in understanding-only training; the ViT and the
  connector stay frozen as ThinkMorph's strong encoder (add them with lora_targets if a task
  needs new visual features: the toy task does, configs/tiny_lora.py).
* remat 'full' (the paper recipe's): compiled for one H100 (`--compile_only=h100:1`,
  2026-12-06, the Pallas attention the GPU runs) 'minimal_flash' puts the train step at
  53.97 GiB (68% of 79.1 GiB; 21.90 under 'full'), which fits the preflight's 85%; the
  recipe stays on 'full' until a GPU measures the lighter policy faster and its peak within
  the prediction (the 1.33x the first H200 showed above a prediction was the check holding a
  second output: docs/gpus.md). The ViT is frozen and runs no backward, so `vit_remat`
  changes nothing here.
* the rollout prefills all 16 prompts at once, the largest program (52.60 GiB for an H100,
  2026-12-07); `--config.rollout_prefill_rows=8` prefills them 8 at a time, each sample
  drawing as before (48.74 GiB), the remedy where a GPU holds less than the preflight counts or a
  second frozen model shares it (a checkpoint teacher per source: docs/runs.md).
* lr 1e-4, ten times the paper's full-rank 1e-5 (min_lr ten times too): the same study finds
  LoRA's best learning rate about 10x full fine-tuning's, nearly independent of rank under the
  alpha / rank scaling; on the toy (configs/tiny_lora.py) 3.3x the full-rank rate learns as
  much as full rank does.
"""

import ml_collections

from configs import thinkmorph_7b


def get_config() -> ml_collections.ConfigDict:
    config = thinkmorph_7b.get_config()
    config.unlock()
    config.lora_rank = 64
    config.lora_alpha = 64.0
    config.lr = 1e-4
    config.min_lr = 1e-6
    config.samples_per_micro_batch = 1
    config.rows_per_micro_batch = 1
    config.gradient_accumulation_steps = 16
    config.num_replicate, config.num_shard, config.num_tensor = 1, -1, 1
    # Prompt buckets up to 6144 tokens: a student row holds the largest image the transform
    # makes, the prompt's text allowance and the completion (6272 tokens), so no trainable
    # prompt is longer. The default's larger buckets would size the sampler's prefill of all 16
    # rows at 16384 tokens (83 GiB: more than the GPU) for prompts that could not be trained.
    config.sample_prompt_buckets = tuple(b for b in config.sample_prompt_buckets if b <= 6144)
    config.results_dir = "results/thinkmorph_7b_1gpu"
    config.lock()
    return config

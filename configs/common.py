"""Every training option with its default, named as in the PyTorch Visual-OPSD trainer.

Configs in this folder start from `base_config()` and change what they need; the result is
locked, so a misspelt key on the command line (`--config.lr_schedular=...`) is an error.
This is the only place a default is written: opsd_jax/run_config turns a config into what the
run uses (loss settings, prompt options, data config, model runtime) and checks the values
(allowed choices, ranges, mesh divisibility) before anything compiles.
"""

import ml_collections


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    # --- model ------------------------------------------------------------------------------------
    c.model_path = ""  # BAGEL / ThinkMorph HF directory (llm_config.json, vit_config.json, ...)
    # auto: as the PyTorch launcher, the student from model.safetensors and the EMA teacher from
    # ema.safetensors when both exist (else the one file for both); ema | model: that file for all;
    # random: no weights read, the configs' model drawn from global_seed (benchmarks at real shapes).
    c.weights = "auto"
    c.compute_dtype = "bfloat16"  # params and optimizer state stay float32
    # auto (pallas on GPU else chunked) | chunked | dense (CPU, one sample per row) | pallas | cudnn
    c.attention_backend = "auto"
    c.remat = (
        "full"  # per-layer rematerialisation: none | full | dots | dots_no_batch | minimal_flash
    )
    c.vit_remat = "same"  # the ViT's own: 'same' (the LLM's) or any of remat's
    # The ViT's own attention backend: 'auto' (the LLM's, as resolved) or any of
    # attention_backend's; 'cudnn' takes its head dim 72 unpadded (the Pallas kernel pads to 128),
    # each image with its length and no mask array (models/attention_cudnn.py)
    c.vit_attention_backend = "auto"
    # The train step's XLA:GPU options (opsd_jax/training/step_compiler_flags.py): xla (XLA's
    # defaults) | maxtext (cuBLAS matmuls, latency-hiding scheduler, per-layer collectives)
    c.step_compiler_flags = "xla"
    c.attention_block = 512  # the chunked attention's tile (tokens); 128 is faster on a CPU
    c.unroll_layers = False  # unroll the LM's layer loop: faster on a CPU, slow to compile at 7B
    # Unroll the decode step's layer loop: on a GPU the token loop becomes one CUDA graph
    # (models/configs.py Qwen2Config.unroll_decode_layers).
    c.unroll_decode_layers = True

    # --- data -------------------------------------------------------------------------------------
    c.toy_data = False  # write the toy task under results_dir if absent (tiny configs)
    c.data_root = ""  # relative dataset paths are read under this folder
    c.data = ml_collections.ConfigDict()
    c.data.datasets = []  # list of dict(name, path, weight, num_used_data)
    # The ViT resize rule (docs/bagel_layout.md §4.1); these values are Visual-OPSD's (BAGEL's chat/eval).
    c.data.image_transform = ml_collections.ConfigDict(
        dict(max_size=980, min_size=378, stride=14, max_pixels=2_007_040)
    )
    c.data.heldout_fraction = 0.05
    c.data.num_threads = 2

    # --- training mode ---------------------------------------------------------------------------
    # opsd: Visual-OPSD (sample, then distil the VT-seeing teacher into the student).
    # sft: the SFT baseline, plain CE on the reference text-only thought + answer (no sampler, no
    # teacher; needs teacher_mode='self' so no EMA copy is kept). offline: distil a cached
    # teacher (below; no sampler, no teacher forward; teacher_mode='self' as for sft).
    c.mode = "opsd"
    # SFT only: share of samples trained in the teacher context (with the VT images) instead of
    # the student context; 0 is the plain baseline, > 0 trains a model that reads VT images.
    c.sft_vt_fraction = 0.0

    # --- offline Visual-OPSD (mode 'offline'): a teacher cached once -----------------------------
    # scripts/collect_traces.py runs the model over the data once and writes the cache to
    # offline_cache_dir; mode 'offline' then trains the student on the text-only view with
    # ce_weight * CE + kd_weight * top-k KL against it (the PyTorch offline trainer's knobs).
    c.offline_cache_dir = ""  # empty: <results_dir>/teacher_cache
    c.kd_weight = 0.5
    c.kd_temperature = 2.0
    c.kd_use_vt_weights = True  # weight each token by KL(teacher with VT || text-only view)
    # full: the student's log-softmax over the whole vocabulary at the cached ids (PyTorch
    # offline trainer); top_k: renormalised over them (the online JSD's support, docs/opsd_loss.md a.1).
    c.kd_student_norm = "full"
    c.offline_top_k = 256  # ids kept per token by the collector
    c.offline_logprob_dtype = "float16"  # float16 | bfloat16 | float32 (cached log-probs)
    c.offline_shard_samples = 200  # samples per committed shard
    # The cached target: 'text_only' = the reference completion (text-only thought, answer), as
    # the PyTorch offline student trains on it, scored by the teacher in its OPSD context (VT
    # images before the completion); 'interleaved' = ThinkMorph's output with the VT images
    # between its thought blocks (the student then learns that format).
    c.offline_target = "text_only"

    # --- Visual-OPSD: teacher and loss ----------------------------------------------------------
    # self | ema | fixed | checkpoint (another model: the BAGEL-layout HF directory teacher_path,
    # frozen in compute_dtype; same tokenizer and image patching as the student, checked at start)
    c.teacher_mode = "ema"
    c.teacher_path = ""
    # A teacher per data source: "name=teacher,name=teacher" over data.datasets' names, each
    # teacher self | ema | fixed | a checkpoint's HF directory (as teacher_path); every dataset
    # named once; it replaces teacher_mode and teacher_path. Each sample is scored by its
    # source's teacher (offline: its cache collected so, from self = model_path's weights or a
    # checkpoint), and the step log has each source's loss (source/<name>/jsd, offline /kd).
    # Empty: one teacher (teacher_mode) for all.
    c.teacher_by_source = ""
    c.ema_decay = 0.995
    c.fixed_teacher_dtype = "float32"  # bfloat16 halves the frozen teacher's memory
    c.jsd_loss_kind = "jsd"  # jsd | tinker
    c.jsd_beta = 0.5
    c.jsd_temperature = 1.0
    c.jsd_top_k = 256
    c.jsd_token_clip = 0.05
    c.jsd_clip_mode = "entry"  # entry | token
    c.jsd_weight = 1.0
    c.ce_weight = 0.0
    c.loss_reduction = "seq_mean"  # seq_mean | token_mean | token_sum

    # --- Visual-OPSD: sampling and prompts --------------------------------------------------------
    c.sample_max_new_tokens = 1024  # total over image-skip rounds
    c.sample_temperature = 1.0
    c.sample_do_sample = True
    c.sample_max_image_skips = 1
    # The rollout's bounded-staleness lookahead (opsd_jax/trainer/rollout.py). 0: a step trains
    # on completions sampled entirely with its own weights. k > 0: slots its rows free while
    # its longest rows still decode start the next k steps' prompts with the current weights;
    # a row unfinished when its step's rows are done pauses and resumes with the next weights,
    # so no token a step trains on is more than k updates old (checked every step; logged as
    # rollout/stale_token_fraction and rollout/staleness_max). The loss is unchanged (student
    # and teacher are recomputed at training time): only the sampling distribution is stale.
    # The paused rows' KV cache stays on the devices through the train step.
    c.rollout_lookahead = 0
    # Prompts the rollout prefills at once at most (0: all of a step's). Fewer lower the
    # prefill's activations, the largest sampling program of a one-GPU run; each later group is
    # prefilled beside the pool's cache and inserted into it (the preflight counts both).
    c.rollout_prefill_rows = 0
    # The sampler decodes on a compute-dtype copy of the student made after every update, laid
    # out for decoding: 'replicated' (every device holds the whole copy), 'tensor' (heads, MLP
    # and vocab split over as many of one host's devices as split every head count, rows over
    # the rest), or 'auto': the one with the least projected rollout time that fits in memory
    # (opsd_jax/sampling/layout_choice.py; train.py prints the choice and its projections).
    c.sampler_layout = "auto"
    # Prompt row lengths (and patches per row) are rounded up to one of these, so the sampler
    # compiles for a bounded set of shapes; a longer prompt is an error. Powers of two up to
    # 2048, then steps of 1024 to 8192 and of 2048 to 16384: above 2048 tokens a prompt is padded
    # by at most 50% (by at most 25% above 4096), where doubling buckets pad up to 100% (a 4.2k
    # ThinkMorph prompt: 5120 cache slots and prefill tokens, not 8192). At most 152 (length,
    # patches) shapes; a run meets a few, each compiled once and printed when first met.
    c.sample_prompt_buckets = (
        64,
        128,
        256,
        512,
        1024,
        2048,
        3072,
        4096,
        5120,
        6144,
        7168,
        8192,
        10240,
        12288,
        14336,
        16384,
    )
    c.use_system_prompt = True
    c.system_prompt = ""  # empty: our default wording (opsd_jax/data/opsd_packs.py)
    c.use_reference_intro = True
    c.reference_intro = ""
    c.use_transition_prompt = True
    c.transition_prompt = ""
    c.instruction_suffix = ""
    c.privileged_thoughts = False  # ablation: reference text thoughts in the teacher context
    c.privileged_answer = False  # ablation: the answer in the teacher context
    c.noise_vt = False  # control: VT images replaced by Gaussian noise
    c.max_forward_tokens = 10240  # teacher pack length; completions truncated to fit
    c.max_reference_rounds = 8

    # --- fixed pack shapes (opsd_jax/data/pack_shapes.py): the train step compiles once per length
    # bucket, before step 1. 0 derives the size from max_forward_tokens, the image transform and
    # sample_max_new_tokens (rounded up to 128); samples share rows where they fit.
    c.pack_row_tokens = 0  # teacher row (OPSD) / row (SFT) length; derived: max_forward_tokens
    c.pack_row_patches = 0  # ViT patches per teacher / SFT row
    c.pack_student_row_tokens = 0  # OPSD student row length
    c.pack_student_row_patches = 0
    c.pack_loss_entries = 0  # loss entries per row (student and teacher packs alike)
    c.pack_length_buckets = 1  # n > 1: n shapes, at 1/n, 2/n, ..., 1 of the sizes above

    # --- optimisation -------------------------------------------------------------------------------
    c.lr = 1e-5
    c.min_lr = 1e-7
    c.warmup_steps = 200
    c.lr_scheduler = "cosine"  # cosine | constant
    c.beta1 = 0.9
    c.beta2 = 0.95
    c.eps = 1e-15
    c.max_grad_norm = 1.0
    c.total_steps = 1000
    c.samples_per_micro_batch = 8  # samples per forward/backward (all processes together)
    c.rows_per_micro_batch = 8  # packed rows they go into (a multiple of data x fsdp)
    c.gradient_accumulation_steps = 2
    c.freeze_llm = False
    c.freeze_vit = False
    # BAGEL's flag: understanding-token activations are detached; with understanding-only data
    # that leaves only lm_head training (opsd_jax/training/train_step.py frozen_groups).
    c.freeze_und = False
    # LoRA (models/lora.py, flax's nnx.LoRA): lora_rank > 0 trains low-rank adapters on the
    # projections whose path matches lora_targets (a regular expression matched in full, e.g.
    # 'vit_model/layers/(q|k|v|out)_proj' or 'connector/fc(1|2)' too); the rest of the model is a
    # frozen base held once in compute_dtype, shared by student, teacher and sampler. The
    # optimizer, the EMA teacher and the checkpoints hold adapters only. 0 = full fine-tuning.
    c.lora_rank = 0
    c.lora_alpha = 32.0  # the adapters' update is scaled by lora_alpha / lora_rank
    # Every projection of the LM's understanding expert (the only one understanding-only
    # training sends tokens through, so the gen expert's adapters would never learn).
    c.lora_targets = "language_model/layers/und/(q|k|v|o|gate|up|down)_proj"

    # --- checkpoints, resume, logging -------------------------------------------------------------
    c.results_dir = "results/run"  # TensorBoard logs, metrics.jsonl, samples
    c.checkpoint_dir = ""  # empty: <results_dir>/checkpoints
    # JAX's persistent compilation cache (opsd_jax/io/compile_cache.py): "auto" =
    # $JAX_COMPILATION_CACHE_DIR, else ~/.cache/opsd-jax/jax-compilation-cache; "" = off.
    c.compilation_cache_dir = "auto"
    c.save_every = 500
    c.max_checkpoints = 3
    c.max_consecutive_bad_steps = 5  # non-finite loss/grad: update skipped; more in a row stops
    c.log_every = 10
    c.auto_resume = True
    c.resume_from = ""  # a checkpoint directory (or one step of it) to start from
    c.resume_model_only = False  # take only the params (and EMA with finetune_from_ema)
    c.finetune_from_ema = False
    # A resume prints every config key that differs from the checkpoint's (saved -> now) and
    # refuses changes that contradict the saved state (model, mode, teacher); True accepts them
    # with the meaning printed (opsd_jax/training/resume_changes.py).
    c.allow_config_change = False
    c.progress_bar = True
    # Held-out evaluation during training (greedy; exact match of the <answer>): 0 = off.
    c.eval_every = 0
    c.eval_at_start = True  # with eval_every: the starting weights too, at step 0 (not on resume)
    c.eval_samples_per_dataset = 64  # first rows of each dataset's held-out split
    c.eval_batch_size = 8  # the engine's slots: rows decoding at once, refilled as rows end
    c.eval_max_new_tokens = 0  # 0: sample_max_new_tokens
    c.eval_contexts = "student"  # comma-separated: student (no VT) and/or teacher (with VT)
    c.wandb_project = ""  # empty: no W&B
    c.wandb_name = ""
    c.wandb_mode = "offline"
    # The W&B run id; empty: a new one on a fresh start, kept in the checkpoints' config, so a
    # resumed run continues the same W&B run (with wandb_resume, wandb.init's `resume`).
    c.wandb_runid = ""
    c.wandb_resume = "allow"  # allow | must | never | auto

    # --- mesh -----------------------------------------------------------------------------------------
    c.num_replicate = 1  # the 'data' axis (HYBRID_SHARD replicas)
    c.num_shard = -1  # the 'fsdp' axis; -1 takes the devices left over
    c.num_tensor = 1
    c.global_seed = 0

    # --- several hosts: one process per host, JAX's distributed runtime ------------------------
    c.distributed = False  # True: jax.distributed.initialize() before anything touches a device
    c.coordinator_address = ""  # "host0:1234"; empty: $JAX_COORDINATOR_ADDRESS or auto-detect
    c.num_processes = -1  # -1: $JAX_NUM_PROCESSES or auto-detect (SLURM, Open MPI, TPU, ...)
    c.process_id = -1  # -1: $JAX_PROCESS_ID or auto-detect
    return c

"""Offline Visual-OPSD: the teacher run once over the data and cached; the student trained on it.

Two views of every sample share one target (the ThinkMorph output, opsd_loss_spec.md §c.2):

    teacher    [system?] [problem image] [question + suffix] [seg_0] [VT_0] [seg_1] ... [seg_n]
    text-only  [system?] [problem image] [question + suffix] [seg_0]        [seg_1] ... [seg_n]

    seg_0 = <think>thought_0</think><image_start>      (each seg is one <|im_start|>..<|im_end|>
    seg_k = <image_end><think>thought_k</think>...      block, scored; the VT image between two
    seg_n = <image_end>[<think>..</think>]<answer>a</answer>    blocks only in the teacher view)

The collector (`collect`, scripts/collect_traces.py) runs the model on both views of a batch and
keeps, per sample and target entry, the teacher's top-k log-probs (tau 1, full-vocabulary
log-softmax) and ids, and the VT-sensitivity weight KL(teacher || text-only view) (losses.
teacher_cache_entries). The offline trainer (train.py mode 'offline') packs the text-only view
and trains on CE + kd_weight * top-k KL against the cache (losses.cached_top_k_kl).

Why the same target tokens in both views (the PyTorch collector instead scores the interleaved
thoughts in the teacher and the curated text-only thought in the student, and aligns the two
sequences from their ends): entry t then compares the two models' predictions of the same token
after the same text, so the cached term is exactly the online top-k KL of the same teacher on
the same completion (tests/test_offline.py checks it to 1e-6), and the VT weight measures what
the VT images change, not a difference of texts.

Cache layout (no pickles; every file is committed by writing `<name>.tmp` and renaming):

    manifest.json          format, model config, tokenizer fingerprint and the settings the
                           cache was made with; the trainer refuses a cache whose model config,
                           tokenizer or prompt differ from its own
    progress-p<i>.json     process i's committed shards (file, sample keys) and skipped keys
    p<i>-<n>.parquet       one row per sample: key, target_ids, top_ids, top_logprobs
                           (float16 / bfloat16 bit patterns as uint16, or float32), vt_weights;
                           one row group per sample, so the trainer reads a sample alone

A shard counts once `progress-p<i>.json` lists it: a crash between the shard's rename and the
progress update leaves an unlisted file, deleted and redone on resume, so a resumed cache holds
every sample exactly once. Processes take rows g with g % count == index (g: the row's index
in the datasets' concatenation) and write only their own files.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import time
from collections import OrderedDict
from collections.abc import Callable

import ml_dtypes
import numpy as np

from models.pack import Pack
from opsd_jax.data.opsd_packs import (
    Encode,
    PromptOptions,
    assign_rows,
    bucket,
    patches_of,
    per_row_max,
    prompt_items,
    shaped_pack,
    teacher_context_items,
)
from opsd_jax.data.pack_shapes import PackShape, choose_bucket
from opsd_jax.data.packing import Image, SpecialTokens, Text, pack_samples, sample_length
from opsd_jax.data.pipeline import reference_completion

CACHE_FORMAT = "opsd-jax offline teacher cache 1"
# The target layouts (bump a version when its layout changes: a cache records it).
TARGET_FORMATS = {"text_only": "reference-completion-1", "interleaved": "thinkmorph-interleaved-1"}
OFFLINE_TARGETS = tuple(TARGET_FORMATS)
MANIFEST = "manifest.json"
LOGPROB_DTYPES = ("float16", "bfloat16", "float32")
_NUMPY_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
TOO_LONG = "too_long"  # skip reason: the teacher view exceeds max_forward_tokens
DUPLICATE = "duplicate_key"  # skip reason: a second row with the same dataset/pid


class CacheError(ValueError):
    """A cache that cannot be used as asked (missing, other model/tokenizer/settings, gaps)."""


# ---- the two views ------------------------------------------------------------------------------


def target_segments(sample, max_reference_rounds: int = 8) -> list[str]:
    """The target text blocks, split where the VT images go (one more block than images)."""
    rounds = min(len(sample.vt_images), max_reference_rounds)
    thoughts = list(sample.thoughts)
    segments = []
    for k in range(rounds):
        head = "<image_end>" if k else ""
        thought = f"<think>{thoughts[k]}</think>" if k < len(thoughts) and thoughts[k] else ""
        segments.append(f"{head}{thought}<image_start>")
    rest = "".join(f"<think>{t}</think>" for t in thoughts[rounds:] if t)
    segments.append(("<image_end>" if rounds else "") + rest + f"<answer>{sample.answer}</answer>")
    return segments


def view_items(sample, encode: Encode, options: PromptOptions, *, with_vt: bool) -> list:
    """The teacher view (with_vt) or the text-only view of `sample`, target blocks scored.

    `options.offline_target` 'text_only': the target is the reference completion (as SFT trains
    on it), after the student prompt or, in the teacher view, the OPSD teacher's context with
    its VT images; 'interleaved': ThinkMorph's output with the VT images between its blocks."""
    if options.offline_target == "text_only":
        context = (teacher_context_items if with_vt else prompt_items)(sample, encode, options)
        return context + [Text(encode(reference_completion(sample)), loss=True)]
    if options.offline_target != "interleaved":
        raise ValueError(f"offline_target={options.offline_target!r}; allowed: "
                         f"{', '.join(map(repr, OFFLINE_TARGETS))}")  # fmt: skip
    items = prompt_items(sample, encode, options)
    segments = target_segments(sample, options.max_reference_rounds)
    for k, text in enumerate(segments):
        items.append(Text(encode(text), loss=True))
        if with_vt and k < len(segments) - 1:
            vt = sample.vt_images[k]
            items.append(Image(vt.patches, vt.position_ids))
    return items


def _loss_entries(items) -> int:
    return sum(len(it.ids) + 1 for it in items if isinstance(it, Text) and it.loss)


@dataclasses.dataclass(frozen=True)
class OfflinePacks:
    student: Pack  # the text-only view
    teacher: Pack | None  # the VT view (collection only), rows and loss entries as `student`
    kept: list[int]  # indices of the packed samples (pack sample id j = kept[j])
    dropped: list[int]  # indices of samples over max_forward_tokens or fitting in no row
    padding_fraction: float  # share of padding tokens in the student pack
    bucket: int = 0  # the length bucket of the fixed shapes used (0 without shapes)


def build_offline_packs(samples, encode: Encode, options: PromptOptions, special: SpecialTokens,
                        *, num_rows: int, max_forward_tokens: int, with_teacher: bool,
                        shapes: list[PackShape] | None = None) -> OfflinePacks:  # fmt: skip
    """Text-only (and, `with_teacher`, VT-view) packs of `samples`, loss entries aligned.

    A sample whose longest packed view exceeds `max_forward_tokens` is dropped, not truncated
    (as in SFT: a cut target would lose the answer). `shapes` (training: the 'offline' shape of
    each length bucket, pack_shapes.pack_shapes) fixes the text-only pack's sizes, so the train
    step compiles once per bucket; a sample that fits in no row of the largest is dropped too.
    Without shapes (collection, tests) the sizes are fitted to the content (powers of two)."""
    if shapes is not None and with_teacher:
        raise ValueError("fixed shapes are for the training (text-only) pack only")
    student_items, teacher_items, kept, dropped = [], [], [], []
    for index, sample in enumerate(samples):
        student = view_items(sample, encode, options, with_vt=False)
        teacher = view_items(sample, encode, options, with_vt=True) if with_teacher else student
        if sample_length(teacher) > max_forward_tokens:
            dropped.append(index)
            continue
        kept.append(index)
        student_items.append(student)
        teacher_items.append(teacher)
    if shapes is not None and kept:
        needs = [[sample_length(i), patches_of(i), _loss_entries(i)] for i in student_items]
        capacities = [np.array(dataclasses.astuple(s)) for s in shapes]
        bucket_index, rows, _ = choose_bucket(needs, capacities, num_rows)  # no cuts: drops
        dropped = sorted(dropped + [kept[i] for i, row in enumerate(rows) if row is None])
        keep = [i for i, row in enumerate(rows) if row is not None]
        kept, student_items = [kept[i] for i in keep], [student_items[i] for i in keep]
        if kept:
            pack = shaped_pack(student_items, shapes[bucket_index], num_rows, special,
                               [rows[i] for i in keep], fixed=True)  # fmt: skip
            padding = float(1.0 - (pack.segment_ids > 0).mean())
            return OfflinePacks(pack, None, kept, dropped, padding, bucket_index)
    if not kept:
        return OfflinePacks(None, None, kept, dropped, 1.0)
    # The longer view decides the rows; both packs then list their entries in the same order.
    rows_of = assign_rows([sample_length(i) for i in teacher_items], num_rows)
    entries = bucket(per_row_max(student_items, rows_of, num_rows, _loss_entries))

    def pack(items):
        return pack_samples(
            items, row_length=bucket(per_row_max(items, rows_of, num_rows, sample_length)),
            num_rows=num_rows,
            max_patches=bucket(per_row_max(items, rows_of, num_rows, patches_of)),
            max_loss_entries=entries, special=special, rows_of=rows_of,
        )  # fmt: skip

    student_pack = pack(student_items)
    teacher_pack = pack(teacher_items) if with_teacher else None
    padding = float(1.0 - (student_pack.segment_ids > 0).mean())
    return OfflinePacks(student_pack, teacher_pack, kept, dropped, padding)


def sample_entries(pack: Pack, j: int) -> tuple[int, np.ndarray]:
    """(row, entry columns) of packed sample j's loss entries, in target order."""
    entries = np.asarray(pack.loss_mask) & (np.asarray(pack.loss_sample) == j)
    row = int(np.argmax(entries.any(axis=1)))
    return row, np.nonzero(entries[row])[0]


def cache_key(sample) -> str:
    return f"{sample.dataset}/{sample.pid}"


# ---- manifest ----------------------------------------------------------------------------------


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the id <-> token table (added tokens included) and the structural ids."""
    vocab = sorted(tokenizer.hf.get_vocab().items(), key=lambda kv: kv[1])
    special = dataclasses.asdict(tokenizer.special_tokens())
    blob = json.dumps([vocab, special, tokenizer.vocab_length], ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


_RUNTIME_KEYS = ("compute_dtype", "attention_backend", "remat")  # do not change the function


def model_fingerprint(model_config) -> dict:
    """The architecture as a JSON-able dict (runtime-only switches left out)."""
    config = dataclasses.asdict(model_config)
    for key in _RUNTIME_KEYS:
        config["llm"].pop(key, None)
    return json.loads(json.dumps(config))


def prompt_settings(options: PromptOptions) -> dict:
    """The prompt fields that shape the two views: with the 'text_only' target the teacher view
    is the OPSD teacher's context, so every prompt option counts; with 'interleaved' the intro,
    transition and ablation texts are not part of either view."""
    if options.offline_target == "text_only":
        fields = dataclasses.asdict(options)
        if not options.noise_vt:
            del fields["noise_seed"]  # only the noise images depend on it
        return dict(fields, target_format=TARGET_FORMATS["text_only"])
    return dict(use_system_prompt=options.use_system_prompt,
                system_prompt=options.system_prompt if options.use_system_prompt else "",
                instruction_suffix=options.instruction_suffix,
                max_reference_rounds=options.max_reference_rounds,
                target_format=TARGET_FORMATS["interleaved"])  # fmt: skip


def make_manifest(model_config, tokenizer, options: PromptOptions, *, top_k: int,
                  logprob_dtype: str, max_forward_tokens: int, data: dict | None = None,
                  model_path: str = "") -> dict:  # fmt: skip
    return {
        "format": CACHE_FORMAT,
        "model_config": model_fingerprint(model_config),
        "model_path": str(model_path),
        "tokenizer": {"sha256": tokenizer_fingerprint(tokenizer),
                      "vocab_length": tokenizer.vocab_length},  # fmt: skip
        "prompt": prompt_settings(options),
        "top_k": int(top_k),
        "logprob_dtype": logprob_dtype,
        "max_forward_tokens": int(max_forward_tokens),
        "data": data or {},
    }


def _differences(saved: dict, current: dict, prefix="") -> list[str]:
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: cache {a!r}, now {b!r}")
    return out


def _write_json_atomic(path: str, value) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise CacheError(f"offline_cache_dir={directory!r}: no {MANIFEST} (make the cache with "
                         "scripts/collect_traces.py)")  # fmt: skip
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format") != CACHE_FORMAT:
        raise CacheError(f"{path}: format {manifest.get('format')!r}, expected {CACHE_FORMAT!r}")
    return manifest


def check_manifest(directory: str, model_config, tokenizer, options: PromptOptions) -> dict:
    """The manifest of the cache in `directory`, refused unless it was made for this model
    config, tokenizer and prompt (one CacheError naming every difference)."""
    manifest = read_manifest(directory)
    current = {"model_config": model_fingerprint(model_config),
               "tokenizer": {"sha256": tokenizer_fingerprint(tokenizer),
                             "vocab_length": tokenizer.vocab_length},
               "prompt": prompt_settings(options)}  # fmt: skip
    problems = _differences({k: manifest.get(k) for k in current}, current)
    if problems:
        raise CacheError(f"{os.path.join(directory, MANIFEST)} was made with another model config,"
                         " tokenizer or prompt than this run; make a new cache (scripts/"
                         "collect_traces.py) or use the matching config:\n  "
                         + "\n  ".join(problems))  # fmt: skip
    return manifest


# ---- shards: writing ----------------------------------------------------------------------------


def _progress_path(directory: str, process: int) -> str:
    return os.path.join(directory, f"progress-p{process}.json")


def _read_progress(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _all_progress(directory: str) -> list[dict]:
    paths = sorted(glob.glob(os.path.join(directory, "progress-p*.json")))
    return [_read_progress(p) for p in paths]


def _schema(logprob_dtype: str):
    import pyarrow as pa

    values = pa.float32() if logprob_dtype == "float32" else pa.uint16()
    return pa.schema([("key", pa.string()), ("target_ids", pa.list_(pa.int32())),
                      ("top_ids", pa.list_(pa.int32())), ("top_logprobs", pa.list_(values)),
                      ("vt_weights", pa.list_(pa.float32()))])  # fmt: skip


def _encode_logprobs(values: np.ndarray, logprob_dtype: str) -> np.ndarray:
    stored = np.asarray(values, np.float32).astype(_NUMPY_DTYPES[logprob_dtype]).reshape(-1)
    return stored if logprob_dtype == "float32" else stored.view(np.uint16)


def _decode_logprobs(values: np.ndarray, logprob_dtype: str) -> np.ndarray:
    if logprob_dtype == "float32":
        return np.asarray(values, np.float32)
    return np.asarray(values, np.uint16).view(_NUMPY_DTYPES[logprob_dtype]).astype(np.float32)


class ShardWriter:
    """Process `process`'s shards: buffered samples -> an atomically committed parquet shard."""

    def __init__(self, directory: str, process: int, logprob_dtype: str, shard_samples: int,
                 on_commit: Callable[[str], None] | None = None):  # fmt: skip
        self.directory, self.process = directory, process
        self.logprob_dtype, self.shard_samples = logprob_dtype, shard_samples
        self.on_commit = on_commit  # called between a shard's rename and its listing (tests)
        path = _progress_path(directory, process)
        self.progress = (_read_progress(path) if os.path.exists(path) else
                         {"process": process, "shards": [], "skipped": {}})  # fmt: skip
        self._rows, self._skipped = [], {}
        listed = {s["file"] for s in self.progress["shards"]}
        # Left-overs of a crash: unfinished tmp files and renamed-but-unlisted shards.
        for path in glob.glob(os.path.join(directory, f"p{process}-*.parquet*")):
            if os.path.basename(path) not in listed:
                os.remove(path)

    def add(self, key: str, target_ids, top_ids, top_logprobs, vt_weights) -> None:
        self._rows.append(dict(
            key=key, target_ids=np.asarray(target_ids, np.int32),
            top_ids=np.asarray(top_ids, np.int32).reshape(-1),
            top_logprobs=_encode_logprobs(top_logprobs, self.logprob_dtype),
            vt_weights=np.asarray(vt_weights, np.float32)))  # fmt: skip
        if len(self._rows) >= self.shard_samples:
            self.commit()

    def skip(self, key: str, reason: str) -> None:
        self._skipped[key] = reason

    def commit(self) -> None:
        """Write the buffered samples as the next shard and list it (with pending skips)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self._rows and not self._skipped:
            return
        entry = None
        if self._rows:
            name = f"p{self.process}-{len(self.progress['shards']):06d}.parquet"
            path = os.path.join(self.directory, name)
            columns = {k: [r[k] for r in self._rows] for k in self._rows[0]}
            table = pa.table(columns, schema=_schema(self.logprob_dtype))
            # One row group per sample: the trainer reads one sample without its neighbours.
            pq.write_table(table, f"{path}.tmp", row_group_size=1, compression="zstd")
            os.replace(f"{path}.tmp", path)
            if self.on_commit is not None:
                self.on_commit(path)
            entry = {"file": name, "keys": columns["key"], "bytes": os.path.getsize(path)}
        progress = dict(self.progress, shards=self.progress["shards"] + ([entry] if entry else []),
                        skipped=dict(self.progress["skipped"], **self._skipped))  # fmt: skip
        _write_json_atomic(_progress_path(self.directory, self.process), progress)
        self.progress, self._rows, self._skipped = progress, [], {}


def done_keys(directory: str) -> set[str]:
    """Keys of every listed sample and every recorded skip, over all processes."""
    done = set()
    for progress in _all_progress(directory):
        for shard in progress["shards"]:
            done.update(shard["keys"])
        done.update(progress["skipped"])
    return done


# ---- shards: reading ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CachedSample:
    target_ids: np.ndarray  # [n] int32: the target tokens and closing <|im_end|>s
    top_ids: np.ndarray  # [n, k] int32
    top_logprobs: np.ndarray  # [n, k] float32 (decoded from the stored dtype)
    vt_weights: np.ndarray  # [n] float32


class CacheReader:
    """Random access to a cache by sample key; stateless, so a resumed run needs only the data
    iterator's state to continue with the same samples and the same cached teacher."""

    def __init__(self, directory: str, manifest: dict | None = None, open_files: int = 4):
        self.directory = directory
        self.manifest = manifest or read_manifest(directory)
        self.top_k = int(self.manifest["top_k"])
        self.logprob_dtype = self.manifest["logprob_dtype"]
        self.where: dict[str, tuple[str, int]] = {}
        self.skipped: dict[str, str] = {}
        for progress in _all_progress(directory):
            for shard in progress["shards"]:
                for row, key in enumerate(shard["keys"]):
                    if key in self.where:
                        raise CacheError(f"{directory}: sample {key!r} is in two shards, "
                                         f"{self.where[key][0]} and {shard['file']}")  # fmt: skip
                    self.where[key] = (shard["file"], row)
            self.skipped.update(progress["skipped"])
        self._files: OrderedDict = OrderedDict()
        self._open_files = open_files

    def __len__(self) -> int:
        return len(self.where)

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def keys(self) -> list[str]:
        return list(self.where)

    def _file(self, name: str):
        import pyarrow.parquet as pq

        if name not in self._files:
            self._files[name] = pq.ParquetFile(os.path.join(self.directory, name))
            if len(self._files) > self._open_files:
                self._files.popitem(last=False)
        self._files.move_to_end(name)
        return self._files[name]

    def lookup(self, key: str) -> CachedSample:
        if key not in self.where:
            raise CacheError(f"sample {key!r} is not in the offline cache {self.directory} (was "
                             "it made over this run's data? is the collection finished?)")  # fmt: skip
        name, row = self.where[key]
        record = self._file(name).read_row_group(row).to_pylist()[0]
        ids = np.asarray(record["top_ids"], np.int32).reshape(-1, self.top_k)
        logprobs = _decode_logprobs(record["top_logprobs"], self.logprob_dtype)
        return CachedSample(np.asarray(record["target_ids"], np.int32), ids,
                            logprobs.reshape(-1, self.top_k),
                            np.asarray(record["vt_weights"], np.float32))  # fmt: skip


# ---- training: one micro-batch's pack and cached teacher ------------------------------------


@dataclasses.dataclass(frozen=True)
class OfflineBatch:
    pack: Pack  # the text-only view
    cache: dict  # top_logprobs [R, C, k] f32, top_ids [R, C, k] i32, vt_weights [R, C] f32
    num_dropped: int  # samples skipped at collection, over max_forward_tokens or fitting no row
    padding_fraction: float
    bucket: int = 0  # the length bucket of the fixed shapes used (0 without shapes)


def empty_cache(num_rows: int, loss_entries: int, top_k: int) -> dict:
    """Zero cache arrays for `num_rows` rows of `loss_entries` entries: what `offline_batch`
    fills (entries without a target keep these zeros; the loss masks them out)."""
    return dict(top_logprobs=np.zeros((num_rows, loss_entries, top_k), np.float32),
                top_ids=np.zeros((num_rows, loss_entries, top_k), np.int32),
                vt_weights=np.zeros((num_rows, loss_entries), np.float32))  # fmt: skip


def offline_batch(samples, reader: CacheReader, encode: Encode, options: PromptOptions,
                  special: SpecialTokens, *, num_rows: int, max_forward_tokens: int,
                  shapes: list[PackShape] | None = None) -> OfflineBatch:  # fmt: skip
    """The student pack of `samples` and the cached teacher at each of its loss entries.

    Samples the collector skipped (too long for its max_forward_tokens) are dropped; a sample
    that is neither cached nor skipped, or whose cached target differs from this run's
    (another tokenizer, prompt or data), is an error naming it. `shapes` fixes the pack's
    sizes (see `build_offline_packs`), and with them the cache arrays' [rows, entries, k]."""
    usable = [s for s in samples if cache_key(s) not in reader.skipped]
    for sample in usable:
        if cache_key(sample) not in reader:
            reader.lookup(cache_key(sample))  # raises the CacheError that names it
    packs = build_offline_packs(usable, encode, options, special, num_rows=num_rows,
                                max_forward_tokens=max_forward_tokens, with_teacher=False,
                                shapes=shapes)  # fmt: skip
    if not packs.kept:
        raise ValueError(f"no sample of the micro-batch is usable (max_forward_tokens="
                         f"{max_forward_tokens}, {len(samples) - len(usable)} skipped by the "
                         "collector" + (f", fixed pack shape {shapes[-1]}" if shapes else "")
                         + ")")  # fmt: skip
    pack = packs.student
    cache = empty_cache(*pack.loss_mask.shape, reader.top_k)
    for j, index in enumerate(packs.kept):
        key = cache_key(usable[index])
        cached = reader.lookup(key)
        row, cols = sample_entries(pack, j)
        if not np.array_equal(pack.loss_targets[row, cols], cached.target_ids):
            raise CacheError(f"sample {key!r}: the cached target ({len(cached.target_ids)} "
                             f"tokens) differs from this run's ({len(cols)} tokens); the cache "
                             f"{reader.directory} was made with another tokenizer, prompt or "
                             "data")  # fmt: skip
        cache["top_logprobs"][row, cols] = cached.top_logprobs
        cache["top_ids"][row, cols] = cached.top_ids
        cache["vt_weights"][row, cols] = cached.vt_weights
    return OfflineBatch(pack, cache, len(samples) - len(packs.kept), packs.padding_fraction,
                        packs.bucket)  # fmt: skip


# ---- collection ----------------------------------------------------------------------------------


def make_collect_step(graphdef, rest, *, top_k: int, vocab_limit: int | None):
    """jit(params, teacher_pack, text_pack) -> (top_logprobs, top_ids, vt_kl) per loss entry."""
    import jax
    from flax import nnx

    from opsd_jax.training import losses

    @jax.jit
    def collect_step(params, teacher_pack, text_pack):
        model = nnx.merge(graphdef, params, rest)
        teacher = model.logits_at(model(teacher_pack), teacher_pack.loss_rows)
        text_only = model.logits_at(model(text_pack), text_pack.loss_rows)
        return losses.teacher_cache_entries(teacher, text_only, teacher_pack.loss_mask, top_k,
                                            vocab_limit=vocab_limit)  # fmt: skip

    return collect_step


def _rows_of_process(data_config, process_index: int, process_count: int):
    """(global index, dataset name, raw record) of every train row this process collects."""
    from opsd_jax.data.sources import open_source

    offset = 0
    for spec in data_config.datasets:
        source = open_source(spec, "train", heldout_fraction=data_config.heldout_fraction,
                             max_reference_rounds=data_config.max_reference_rounds)  # fmt: skip
        for r in range(len(source)):
            if (offset + r) % process_count == process_index:
                yield offset + r, spec.name, source, r
        offset += len(source)


def _eta(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"


@dataclasses.dataclass
class CollectSummary:
    written: int
    skipped: dict
    already_done: int
    seconds: float


def collect(*, collect_step, params, tokenizer, data_config, options: PromptOptions, mesh,
            directory: str, manifest: dict, samples_per_batch: int, rows_per_batch: int,
            max_forward_tokens: int, shard_samples: int, process_index: int = 0,
            process_count: int = 1, max_samples: int | None = None,
            log: Callable[[str], None] = print, log_every_s: float = 10.0,
            on_commit: Callable[[str], None] | None = None) -> CollectSummary:  # fmt: skip
    """Run the teacher over this process's rows in batches and commit shards as they fill.

    Resumable: rows whose key a previous run listed (or recorded as skipped) are not read
    again. `max_samples` stops after that many new samples (tests, dry runs). Progress (done /
    total, rate, ETA) is logged at most every `log_every_s` seconds, and at the end."""
    import jax

    from opsd_jax.data.pipeline import prepare_sample
    from opsd_jax.data.sources import Skipped, decode_row
    from opsd_jax.parallel import distributed
    from opsd_jax.parallel import mesh as mesh_lib

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, MANIFEST)
    if os.path.exists(path):
        problems = _differences(read_manifest(directory), manifest)
        if problems:
            raise CacheError(f"{path}: this cache was made with other settings; use another "
                             "directory or the same settings:\n  " + "\n  ".join(problems))  # fmt: skip
    else:
        _write_json_atomic(path, manifest)
    writer = ShardWriter(directory, process_index, manifest["logprob_dtype"], shard_samples,
                         on_commit)  # fmt: skip
    done = done_keys(directory)
    todo = [row for row in _rows_of_process(data_config, process_index, process_count)]
    start, written, already, skipped = time.perf_counter(), 0, 0, {}
    last_log = start
    special = tokenizer.special_tokens()

    def skip(key, reason):
        writer.skip(key, reason)
        skipped[reason] = skipped.get(reason, 0) + 1

    def report(final=False):
        nonlocal last_log
        now = time.perf_counter()
        if not final and now - last_log < log_every_s:
            return
        last_log = now
        left = len(todo) - already - written - sum(skipped.values())
        rate = written / max(now - start, 1e-9)
        log(f"[p{process_index}] {written + already + sum(skipped.values())}/{len(todo)} samples "
            f"({already} cached before, {sum(skipped.values())} skipped), {rate:.2f} samples/s, "
            f"ETA {_eta(left / rate) if rate > 0 else '?'}")  # fmt: skip

    def run(batch):
        nonlocal written
        packs = build_offline_packs([s for _, s in batch], tokenizer.encode, options, special,
                                    num_rows=rows_per_batch, max_forward_tokens=max_forward_tokens,
                                    with_teacher=True)  # fmt: skip
        for index in packs.dropped:
            skip(batch[index][0], TOO_LONG)
        if packs.kept:
            with mesh_lib.use_mesh(mesh):
                outputs = collect_step(params, distributed.put_rows(packs.teacher, mesh),
                                       distributed.put_rows(packs.student, mesh))  # fmt: skip
            top_logprobs, top_ids, kl = (np.asarray(jax.device_get(x)) for x in outputs)
            for j, index in enumerate(packs.kept):
                row, cols = sample_entries(packs.teacher, j)
                targets = packs.teacher.loss_targets[row, cols]
                writer.add(batch[index][0], targets, top_ids[row, cols], top_logprobs[row, cols],
                           kl[row, cols])  # fmt: skip
                written += 1
        report()

    batch, seen = [], set()
    for _, name, source, r in todo:
        if max_samples is not None and written + len(batch) >= max_samples:
            break
        record = source[r]
        key = f"{name}/{record.get('pid')}"  # as cache_key(sample): decode_row keeps str(pid)
        if key in done:
            already += 1
            continue
        if key in seen:  # a repeated dataset/pid: the first row is the one cached
            skipped[DUPLICATE] = skipped.get(DUPLICATE, 0) + 1
            continue
        seen.add(key)
        raw = decode_row(record, name, max_reference_rounds=data_config.max_reference_rounds,
                         max_question_chars=data_config.max_question_chars,
                         require_vt=data_config.require_vt)  # fmt: skip
        sample = raw if isinstance(raw, Skipped) else prepare_sample(raw, data_config)
        if isinstance(sample, Skipped):
            skip(key, sample.reason)
            continue
        batch.append((key, sample))
        if len(batch) == samples_per_batch:
            run(batch)
            batch = []
    if batch:
        run(batch)
    writer.commit()
    report(final=True)
    return CollectSummary(written, skipped, already, time.perf_counter() - start)


def cache_bytes(directory: str) -> tuple[int, int]:
    """(bytes of listed shards, samples in them)."""
    total, count = 0, 0
    for progress in _all_progress(directory):
        for shard in progress["shards"]:
            total += shard["bytes"]
            count += len(shard["keys"])
    return total, count


"""Offline Visual-OPSD: the teacher run once over the data and cached; the student trained on it.

Two views of every sample share one target, scored in both; `offline_target` says which:

* 'text_only' (default): the reference completion (the text-only thought, then the answer, as
  SFT trains on it and as the PyTorch offline student sees it) after each view's context:

    teacher    [system?] [problem image] [question + suffix] [intro?] [VT_0 ..] [transition?] [target]
    text-only  [system?] [problem image] [question + suffix]                                  [target]

  The teacher view is exactly the OPSD teacher's (opsd_packs.teacher_context_items), so the
  cached term is the on-policy distillation term on the reference completion instead of a
  sampled one.
* 'interleaved': ThinkMorph's output with the VT images between its blocks (docs/opsd_loss.md §c.2); the student
  then learns that format:

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

Cache layout (no pickles; every file is committed by writing `<name>.<unique>.tmp` and renaming):

    manifest.json          format, model config, tokenizer fingerprint, the teacher's weights
                           (digest) and the settings the cache was made with (data and image
                           transform included); the trainer refuses a cache whose model config,
                           tokenizer, prompt, image transform or teacher differ from its own
    progress-p<i>.json     process i's committed shards (file, sample keys, bytes), skipped
                           keys, and `finished` once it went through all its rows
    p<i>-<n>.parquet       one row per sample: key, target_ids, top_ids, top_logprobs
                           (float16 / bfloat16 bit patterns as uint16, or float32), vt_weights;
                           one row group per sample, so the trainer reads a sample alone

A shard counts once `progress-p<i>.json` lists it: a crash between the shard's rename and the
progress update leaves an unlisted file, deleted and redone on resume, so a resumed cache holds
every sample exactly once. Processes take rows g with g % count == index (g: the row's index
in the datasets' concatenation) and write only their own files. Opening a cache checks what
can be checked without reading it: every listed shard present at its recorded size, every JSON
file whole (a CacheError naming the file, not the first step's pyarrow error).

One module of about 560 lines: the format on disk, its writer and its reader in one place, so
the layout is defined once.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping

import ml_dtypes
import numpy as np

from models import configs as model_configs
from opsd_jax.data.opsd_packs import PromptOptions
from opsd_jax.io import weights_digest

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


def cache_key(sample) -> str:
    return f"{sample.dataset}/{sample.pid}"


# ---- manifest ----------------------------------------------------------------------------------


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the id <-> token table (added tokens included) and the structural ids."""
    vocab = sorted(tokenizer.hf.get_vocab().items(), key=lambda kv: kv[1])
    special = dataclasses.asdict(tokenizer.special_tokens())
    blob = json.dumps([vocab, special, tokenizer.vocab_length], ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


# Switches that change how the model computes, not what (a cache made with one fits the others).
# The gen expert's capacity is one too: OPSD never routes a token to the gen expert.
_RUNTIME_KEYS = (
    model_configs.RUNTIME_FIELDS + model_configs.DERIVED_RUNTIME_FIELDS + ("gen_token_capacity",)
)


def _architecture(config: dict) -> dict:
    """A model config dict without its runtime-only LM switches (a saved one may hold them:
    a cache written before a switch was counted as runtime-only)."""
    llm = config.get("llm") if isinstance(config, dict) else None
    if not isinstance(llm, dict):
        return config
    return dict(config, llm={k: v for k, v in llm.items() if k not in _RUNTIME_KEYS})


def model_fingerprint(model_config) -> dict:
    """The architecture as a JSON-able dict (runtime-only switches left out)."""
    return json.loads(json.dumps(_architecture(dataclasses.asdict(model_config))))


def prompt_settings(options: PromptOptions) -> dict:
    """The prompt fields that shape the two views: with the 'text_only' target the teacher view
    is the OPSD teacher's context, so every prompt option counts; with 'interleaved' the intro,
    transition and ablation texts are not part of either view."""
    if options.offline_target == "text_only":
        fields = dataclasses.asdict(options)
        if not options.noise_vt:
            del fields["noise_seed"]  # only the noise images depend on it
        return dict(fields, target_format=TARGET_FORMATS["text_only"])
    return dict(
        use_system_prompt=options.use_system_prompt,
        system_prompt=options.system_prompt if options.use_system_prompt else "",
        instruction_suffix=options.instruction_suffix,
        max_reference_rounds=options.max_reference_rounds,
        target_format=TARGET_FORMATS["interleaved"],
    )


def make_manifest(
    model_config,
    tokenizer,
    options: PromptOptions,
    *,
    top_k: int,
    logprob_dtype: str,
    max_forward_tokens: int,
    data: dict | None = None,
    model_path: str = "",
    teacher: dict | None = None,
    teachers_by_source: Mapping[str, dict | None] | None = None,
) -> dict:
    """`teacher`: the identity (io/weights_digest.py) of a teacher from another checkpoint
    (teacher_mode='checkpoint'); None: the student's starting weights of model_path.
    `teachers_by_source`: with a teacher per data source, each dataset's (None: model_path's
    weights); `model_config` is then the student's."""
    manifest = {
        "format": CACHE_FORMAT,
        "model_config": model_fingerprint(model_config),
        "model_path": str(model_path),
        "teacher": None if teacher is None else dict(teacher),
        "tokenizer": {
            "sha256": tokenizer_fingerprint(tokenizer),
            "vocab_length": tokenizer.vocab_length,
        },
        "prompt": prompt_settings(options),
        "top_k": int(top_k),
        "logprob_dtype": logprob_dtype,
        "max_forward_tokens": int(max_forward_tokens),
        "data": data or {},
    }
    if teachers_by_source:
        manifest["teachers_by_source"] = {
            name: None if t is None else dict(t) for name, t in teachers_by_source.items()
        }
    return manifest


def differences(saved: dict, current: dict, prefix="") -> list[str]:
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: cache {a!r}, now {b!r}")
    return out


def _write_tmp_json(path: str, value) -> str:
    # A name of this process and call: processes starting together on one new directory each
    # write their own tmp file (one shared name: the slower rename found it moved away).
    tmp = f"{path}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def write_json_atomic(path: str, value) -> None:
    os.replace(_write_tmp_json(path, value), path)


def create_json(path: str, value) -> bool:
    """Write `path` unless it exists, atomically: True if this call made it. Of processes
    creating it at once one wins; the others leave it as it is (and should read it back)."""
    tmp = _write_tmp_json(path, value)
    try:
        os.link(tmp, path)  # atomic, and fails where the file exists
        return True
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: the last rename wins
        os.replace(tmp, path)
        tmp = None
        return True
    finally:
        if tmp is not None:
            os.remove(tmp)


def read_json(path: str):
    """A JSON file of the cache; one cut short (a copy or rsync interrupted, a full disk) is a
    CacheError naming it, not the decoder's message alone."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CacheError(
            f"{path} is not valid JSON ({e}): cut short or damaged (a copy interrupted, a full "
            "disk?); copy the cache again, or collect a new one (scripts/collect_traces.py)"
        ) from None


def read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise CacheError(
            f"offline_cache_dir={directory!r}: no {MANIFEST} (make the cache with "
            "scripts/collect_traces.py)"
        )
    manifest = read_json(path)
    if not isinstance(manifest, dict) or manifest.get("format") != CACHE_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CacheError(f"{path}: format {found!r}, expected {CACHE_FORMAT!r}")
    return manifest


def describe_teacher(identity: dict | None) -> str:
    """A teacher's identity in words (None: model_path's weights, in a cache made before the
    weights of a `self` teacher were recorded)."""
    if identity is None:
        return "model_path's weights (no digest recorded)"
    if identity.get("checkpoint"):
        return f"checkpoint {identity['model_path']} (digest {identity['digest'][:12]})"
    return weights_digest.describe(identity)


def check_manifest(
    directory: str,
    model_config,
    tokenizer,
    options: PromptOptions,
    teacher: dict | None = None,
    teachers_by_source: Mapping[str, dict | None] | None = None,
    image_transform: dict | None = None,
) -> dict:
    """The manifest of the cache in `directory`, refused unless it was made for this model
    config, tokenizer and prompt, by this teacher (`teacher`: the identity of its weights,
    checks.teacher_identity for a `self` one) or these teachers per data source
    (`teachers_by_source`), and, given, with this `image_transform` (its fields), in one
    CacheError naming every difference."""
    manifest = read_manifest(directory)
    current = {
        "model_config": model_fingerprint(model_config),
        "tokenizer": {
            "sha256": tokenizer_fingerprint(tokenizer),
            "vocab_length": tokenizer.vocab_length,
        },
        "prompt": prompt_settings(options),
    }
    saved = {k: manifest.get(k) for k in current}
    saved["model_config"] = _architecture(saved["model_config"])
    if image_transform is not None:  # it shapes the views' images (their patches)
        current["data"] = {"image_transform": dict(image_transform)}
        saved["data"] = {"image_transform": (manifest.get("data") or {}).get("image_transform")}
    problems = differences(saved, current)
    who = describe_teacher
    digest = lambda t: (t or {}).get("digest")  # noqa: E731
    made_by, by_source = manifest.get("teacher"), manifest.get("teachers_by_source") or {}
    if digest(made_by) != digest(teacher):
        problems.append(f"teacher: cache {who(made_by)}, now {who(teacher)}")
    for name in sorted(set(by_source) | set(teachers_by_source or {})):
        saved, now = by_source.get(name, made_by), (teachers_by_source or {}).get(name, teacher)
        if digest(saved) != digest(now):
            problems.append(f"teacher of {name}: cache {who(saved)}, now {who(now)}")
    if problems:
        raise CacheError(
            f"{os.path.join(directory, MANIFEST)} was made with another model config,"
            " tokenizer, prompt, image transform or teacher than this run; make a new cache"
            " (scripts/collect_traces.py) or use the matching config:\n  " + "\n  ".join(problems)
        )
    return manifest


# ---- shards: writing ----------------------------------------------------------------------------


def _progress_path(directory: str, process: int) -> str:
    return os.path.join(directory, f"progress-p{process}.json")


def _read_progress(path: str) -> dict:
    progress = read_json(path)
    if not isinstance(progress, dict) or not {"shards", "skipped"} <= set(progress):
        raise CacheError(f"{path}: not a progress file of this cache format (no shards/skipped)")
    return progress


def _all_progress(directory: str) -> list[dict]:
    paths = sorted(glob.glob(os.path.join(directory, "progress-p*.json")))
    return [_read_progress(p) for p in paths]


def _schema(logprob_dtype: str):
    import pyarrow as pa

    values = pa.float32() if logprob_dtype == "float32" else pa.uint16()
    return pa.schema(
        [
            ("key", pa.string()),
            ("target_ids", pa.list_(pa.int32())),
            ("top_ids", pa.list_(pa.int32())),
            ("top_logprobs", pa.list_(values)),
            ("vt_weights", pa.list_(pa.float32())),
        ]
    )


def _encode_logprobs(values: np.ndarray, logprob_dtype: str) -> np.ndarray:
    stored = np.asarray(values, np.float32).astype(_NUMPY_DTYPES[logprob_dtype]).reshape(-1)
    return stored if logprob_dtype == "float32" else stored.view(np.uint16)


def _decode_logprobs(values: np.ndarray, logprob_dtype: str) -> np.ndarray:
    if logprob_dtype == "float32":
        return np.asarray(values, np.float32)
    return np.asarray(values, np.uint16).view(_NUMPY_DTYPES[logprob_dtype]).astype(np.float32)


class ShardWriter:
    """Process `process`'s shards: buffered samples -> an atomically committed parquet shard."""

    def __init__(
        self,
        directory: str,
        process: int,
        logprob_dtype: str,
        shard_samples: int,
        on_commit: Callable[[str], None] | None = None,
    ):
        self.directory, self.process = directory, process
        self.logprob_dtype, self.shard_samples = logprob_dtype, shard_samples
        self.on_commit = on_commit  # called between a shard's rename and its listing (tests)
        path = _progress_path(directory, process)
        self.progress = (
            _read_progress(path)
            if os.path.exists(path)
            else {"process": process, "shards": [], "skipped": {}}
        )
        self._rows, self._skipped = [], {}
        listed = {s["file"] for s in self.progress["shards"]}
        # Left-overs of a crash: unfinished tmp files and renamed-but-unlisted shards.
        for path in glob.glob(os.path.join(directory, f"p{process}-*.parquet*")):
            if os.path.basename(path) not in listed:
                os.remove(path)

    def add(self, key: str, target_ids, top_ids, top_logprobs, vt_weights) -> None:
        self._rows.append(
            dict(
                key=key,
                target_ids=np.asarray(target_ids, np.int32),
                top_ids=np.asarray(top_ids, np.int32).reshape(-1),
                top_logprobs=_encode_logprobs(top_logprobs, self.logprob_dtype),
                vt_weights=np.asarray(vt_weights, np.float32),
            )
        )
        if len(self._rows) >= self.shard_samples:
            self.commit()

    def skip(self, key: str, reason: str) -> None:
        self._skipped[key] = reason

    def finish(self, process_count: int) -> None:
        """Commit what is buffered and record that this process went through all its rows of
        a `process_count`-process collection (checks.check_covers reads it)."""
        self.commit()
        progress = dict(self.progress, finished={"process_count": int(process_count)})
        write_json_atomic(_progress_path(self.directory, self.process), progress)
        self.progress = progress

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
        progress = dict(
            self.progress,
            shards=self.progress["shards"] + ([entry] if entry else []),
            skipped=dict(self.progress["skipped"], **self._skipped),
        )
        write_json_atomic(_progress_path(self.directory, self.process), progress)
        self.progress, self._rows, self._skipped = progress, [], {}


def done_keys(directory: str) -> set[str]:
    """Keys of every listed sample and every recorded skip, over all processes."""
    done = set()
    for progress in _all_progress(directory):
        for shard in progress["shards"]:
            done.update(shard["keys"])
        done.update(progress["skipped"])
    return done


def finished_processes(directory: str) -> tuple[dict[int, int], set[int]]:
    """({process index: the process count of the collection it finished}, those counts)."""
    finished = {}
    for progress in _all_progress(directory):
        if progress.get("finished"):
            finished[int(progress["process"])] = int(progress["finished"]["process_count"])
    return finished, set(finished.values())


# ---- shards: reading ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CachedSample:
    target_ids: np.ndarray  # [n] int32: the target tokens and closing <|im_end|>s
    top_ids: np.ndarray  # [n, k] int32
    top_logprobs: np.ndarray  # [n, k] float32 (decoded from the stored dtype)
    vt_weights: np.ndarray  # [n] float32


def _shard_problems(directory: str, progress: dict, shard: dict) -> list[str]:
    """What is wrong with a listed shard's file: missing, or another size than the progress
    file recorded when it was committed (checked without reading it)."""
    path = os.path.join(directory, shard["file"])
    listed_by = f"progress-p{progress.get('process', '?')}.json"
    if not os.path.isfile(path):
        return [f"{path}: missing (listed by {listed_by})"]
    size = os.path.getsize(path)
    if "bytes" in shard and size != shard["bytes"]:
        return [f"{path}: {size} bytes, {listed_by} recorded {shard['bytes']}"]
    return []


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
        damaged = []
        for progress in _all_progress(directory):
            for shard in progress["shards"]:
                damaged += _shard_problems(directory, progress, shard)
                for row, key in enumerate(shard["keys"]):
                    if key in self.where:
                        raise CacheError(
                            f"{directory}: sample {key!r} is in two shards, "
                            f"{self.where[key][0]} and {shard['file']}"
                        )
                    self.where[key] = (shard["file"], row)
            self.skipped.update(progress["skipped"])
        if damaged:
            # Found here, before the model loads, not at the first step that reads the shard.
            raise CacheError(
                f"offline cache {directory}: {len(damaged)} listed shard(s) missing or not as "
                "written (a copy cut short, a full disk?); copy the cache again, or collect a "
                "new one (scripts/collect_traces.py):\n  " + "\n  ".join(damaged[:10])
            )
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
        import pyarrow as pa

        if key not in self.where:
            raise CacheError(
                f"sample {key!r} is not in the offline cache {self.directory} (was "
                "it made over this run's data? is the collection finished?)"
            )
        name, row = self.where[key]
        try:
            record = self._file(name).read_row_group(row).to_pylist()[0]
        except (pa.ArrowException, OSError) as e:
            # Damaged after the open's size check (or inside, at the same size): named.
            raise CacheError(
                f"offline cache shard {os.path.join(self.directory, name)} (sample {key!r}) "
                f"cannot be read: {e}"
            ) from None
        ids = np.asarray(record["top_ids"], np.int32).reshape(-1, self.top_k)
        logprobs = _decode_logprobs(record["top_logprobs"], self.logprob_dtype)
        return CachedSample(
            np.asarray(record["target_ids"], np.int32),
            ids,
            logprobs.reshape(-1, self.top_k),
            np.asarray(record["vt_weights"], np.float32),
        )


def cache_bytes(directory: str) -> tuple[int, int]:
    """(bytes of listed shards, samples in them)."""
    total, count = 0, 0
    for progress in _all_progress(directory):
        for shard in progress["shards"]:
            total += shard["bytes"]
            count += len(shard["keys"])
    return total, count

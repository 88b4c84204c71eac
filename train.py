"""opsd-jax: Visual-OPSD training.  python train.py --config configs/<name>.py [--config.key=value]

`main` is the run, top to bottom, each stage a call into an object that owns it:
config check -> distributed init -> run lock, data check -> mesh
-> the start state, fresh or resumed (opsd_jax/trainer/start.py)
-> data -> the train step compiled per length bucket (trainer/step_program.py)
-> the rollout (trainer/rollout.py), the held-out evaluation (trainer/held_out.py)
-> loop [sample completions -> pack -> one compiled step -> log (trainer/step_log.py) -> save]
-> the closing lines (trainer/run_end.py).

What differs by mode lives in the package: the config in opsd_jax/run_config, the loss in
training/train_step.make_loss, each step's micro-batches in training/step_batches.py (OPSD, SFT,
offline: one interface), the rollout in trainer/rollout.py (SFT and offline sample nothing). A
dispatched step is a `DispatchedStep` until it is logged; the run's end is a `RunEnd`, its closing lines. Kept here: the flags, `say`,
`main`, and the one-line error handling of `run` (an error in what the user gave, or one the OS
reported, ends the run with one line, not a traceback).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import os
import signal
import sys
from typing import NoReturn

import jax
from absl import app, flags, logging

from opsd_jax import run_config
from opsd_jax.data import sources
from opsd_jax.data.pipeline import check_split_sizes, make_iterator
from opsd_jax.io import compile_cache, disk_errors, run_lock
from opsd_jax.io.checkpoint import Checkpointer, CheckpointError, CheckpointWriteError
from opsd_jax.io.hf_layout import HFCheckpointError
from opsd_jax.io.hf_load import read_config
from opsd_jax.io.safetensors_io import SafetensorsError
from opsd_jax.parallel import distributed
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.run_config import preflight
from opsd_jax.toy import assets as toy_assets
from opsd_jax.trainer import run_end, step_log, step_program
from opsd_jax.trainer import start as start_lib
from opsd_jax.trainer.held_out import HeldOut
from opsd_jax.trainer.rollout import Rollout
from opsd_jax.trainer.run_end import RunEnd, chance_of, next_commands
from opsd_jax.trainer.step_log import DispatchedStep, TooManyBadSteps
from opsd_jax.trainer.step_samples import SampleQueue
from opsd_jax.training import step_flops
from opsd_jax.training.metrics import wandb_run_id
from opsd_jax.training.offline import cache as offline_cache
from opsd_jax.training.stop_request import StopRequest

# The stages' objects that tests and scripts name as train's.
__all__ = [
    "DispatchedStep",
    "OpenedCheckpoints",
    "RunEnd",
    "TooManyBadSteps",
    "USER_ERRORS",
    "chance_of",
    "disk_error_line",
    "exit_with_one_line",
    "main",
    "next_commands",
    "one_line_error",
    "run",
    "say",
    "tune_the_collector",
]

_COMPILE_ONLY = flags.DEFINE_string(
    "compile_only",
    None,
    "TARGET:DEVICES (e.g. h100:8): compile every program of the run for that many compile-only "
    "GPUs, print each one's peak memory per device and exit 0 if all leave 15% free, else 1; "
    "no GPU, weights or data are needed (opsd_jax/run_config/preflight.py)",
)


def say(*args) -> None:
    """Console output from the main process only."""
    if distributed.is_main():
        print(*args, flush=True)


def main(argv, opened: OpenedCheckpoints | None = None):
    """The run, top to bottom. Over 150 lines because it is the sequence itself: each block is
    a check or a call into one stage of opsd_jax/trainer/, and the loop that ties them; split
    further, a reader would jump between functions that only pass the same objects on."""
    del argv
    opened = OpenedCheckpoints() if opened is None else opened
    logging.set_verbosity(logging.WARNING)  # jax's backend probing is noise here
    config = run_config.config_flag_value()

    # ---- config check: every bad value named before anything compiles ------------------------
    run_config.resolve_paths(config)
    try:
        # Values only: no device may be touched before the init (a preflight reads no file).
        run_config.validate(config, check_files=_COMPILE_ONLY.value is None)
    except run_config.ConfigError as e:
        run_config.config_error(e)

    # ---- or only ask the compiler: does the run fit that GPU? (nothing runs, nothing is read) --
    if _COMPILE_ONLY.value is not None:  # an empty value too: refused, never a real run
        try:
            sys.exit(preflight.run(config, _COMPILE_ONLY.value))
        except (preflight.PreflightError, run_config.ConfigError) as e:
            run_config.config_error(e)

    # ---- distributed init (one process per host), then the checks that need the devices -------
    try:
        one_process = distributed.initialize(config)
    except ValueError as e:  # jax's: a process count, id or address missing or out of range
        run_config.config_error(
            f"distributed=True: {e} (from the config's num_processes / process_id / "
            "coordinator_address, else JAX_NUM_PROCESSES / JAX_PROCESS_ID / "
            "JAX_COORDINATOR_ADDRESS)"
        )
    if one_process:
        say(one_process)
    # JAX's persistent compilation cache, before anything compiles.
    cache_dir = compile_cache.resolve(config.compilation_cache_dir)
    if cache_dir:
        compile_cache.enable(cache_dir, every_program=jax.process_count() == 1)
    cache_counter = compile_cache.CacheCounter()
    try:
        run_config.validate(config, jax.device_count(), jax.process_count())
    except run_config.ConfigError as e:
        run_config.config_error(e)
    num_processes = jax.process_count()
    if num_processes > 1:
        say(f"{num_processes} processes, {jax.local_device_count()} devices each")

    # ---- one run per directory: a second run on the same results_dir refuses here -----------
    checkpoint_dir = config.checkpoint_dir or os.path.join(config.results_dir, "checkpoints")
    # Both, each by its own run.lock (results_dir's first; one lock if they are the same): a
    # run whose checkpoint_dir is another run's <results_dir>/checkpoints meets that run's lock
    # there, whichever of the two started first.
    try:
        run_lock.acquire_for_run([config.results_dir, checkpoint_dir], say=say)
    except run_lock.RunLockError as e:
        run_config.config_error(e)
    if config.toy_data:
        toy_assets.prepare_toy_assets(config)
    # Every data file opens and has the required columns, before anything is loaded or compiled.
    data_check = run_config.data_config(config)
    problem = None  # this process's; the processes agree below (a data copy missing on a host)
    cache_reader = None  # offline mode's teacher cache, opened here and used by the step
    try:
        for spec in data_check.datasets:
            sources.check_dataset(spec, require_vt=data_check.require_vt)
        # ... and each split the run reads has rows (an empty held-out split, a train split
        # smaller than the processes), before the model loads: the iterators would raise after.
        check_split_sizes(data_check, num_processes, evaluates=config.eval_every > 0)
        cache_reader = step_program.check_offline_cache_files(config, data_check)
        # The model's own config (a toy run's is written just above): its heads against
        # num_tensor, and LoRA's targets against its projections.
        model_config = read_config(run_config.model_dir(config))
        problem = "; ".join(run_config.tensor_problems(config, model_config)) or None
        if run_config.TrainedSplit.of_config(config).lora:
            run_config.lora_target_paths(config, model_config)
    except (sources.DataError, offline_cache.CacheError, OSError, ValueError) as e:
        problem = str(e)
    if distributed.all_processes(problem is not None).any():  # every process stops, or none
        run_config.config_error(problem or "another process refused its data (see its output)")

    # ---- mesh ----------------------------------------------------------------------------------
    data_size, fsdp_size, tensor_size = run_config.mesh_shape(config, jax.device_count())
    mesh = mesh_lib.make_mesh(data_size, fsdp_size, tensor_size)
    say(f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} device(s)")
    say(f"compilation cache: {cache_dir or 'off (compilation_cache_dir)'}")

    # ---- the start: fresh, or resumed from a checkpoint (then the HF weights are not read) ----
    # A save the disk refuses ends the run with one line (run()), not orbax's hundred.
    disk_errors.quiet_abandoned_saves()
    checkpointer = Checkpointer(
        checkpoint_dir, save_every=config.save_every, max_to_keep=config.max_checkpoints
    )
    opened.checkpointer, opened.auto_resume = checkpointer, config.auto_resume
    start = start_lib.open_start(config, mesh, checkpointer, checkpoint_dir, say)  # start.py
    state, start.state, start_step = start.state, None, start.start_step

    # ---- data: each process reads its own blocks of the global sample stream (data/pipeline.py)
    # The model's ViT patch size and position grid decide the images' patches and position ids.
    data_config = data_check.for_model(start.model_config)  # the config checked before the load
    per_micro, accum = config.samples_per_micro_batch, config.gradient_accumulation_steps
    data = make_iterator(data_config, "train", process_block=per_micro // num_processes)
    if start.data_state:
        data.set_state(start.data_state)
    if start.resumed:
        say(f"resumed from {start.resumed} at step {start_step}")
    if config.wandb_project:
        # One W&B run across restarts: the id goes into every checkpoint's config and a resume
        # of this run (its own checkpoint_dir, not another run's) reads it back.
        own = start.saved_config if start.resumed == checkpoint_dir else None
        config.wandb_runid = wandb_run_id(config.wandb_runid, own)

    def close(logger, summary, stopped_at: int | None, trained_data_state=None) -> None:
        """Wait for the last save, close the logs, say the closing lines (run_end.py).
        `trained_data_state`: the data iterator's state after the last step trained (with
        rollout_lookahead the iterator itself has read further)."""
        run_end.close_run(
            config,
            checkpoint_dir,
            checkpointer,
            logger,
            trained_data_state or data.get_state(),
            summary,
            (start_step, stopped_at),
            (cache_dir, cache_counter),
            say,
        )

    # ---- a finished run launched again: no step or rollout to compile (minutes at 7B), only
    # the closing lines. A fresh run of total_steps=0 still evaluates its baseline below. ------
    if start_step >= config.total_steps and (start_step > 0 or not config.eval_at_start):
        say(f"nothing left to train: step {start_step} >= total_steps={config.total_steps}")
        logger = step_log.open_logger(config, start_step)
        log = step_log.StepLog(
            config, logger, checkpointer, checkpoint_dir, start, None, start.resumed
        )
        close(logger, log.summary, None)
        return

    # ---- the train step, compiled for every length bucket (step_program.py) ----------------
    options = run_config.prompt_options(config)  # the same wording everywhere
    program = step_program.compile_steps(
        config, mesh, start, options, cache_counter, say, num_processes, cache_reader
    )
    logger = step_log.open_logger(config, start_step)
    say(step_log.describe_training(config, start_step))
    log = step_log.StepLog(
        config, logger, checkpointer, checkpoint_dir, start, program.batches, start.resumed
    )

    # ---- the rollout (rollout.py: layout, decode copy, engine; SFT and offline sample nothing),
    # the held-out evaluation (held_out.py: in the rollout's layout) ----------------------------
    rollout = Rollout(config, mesh, start, options, program, logger, say)
    held_out = HeldOut(config, mesh, start, data_config, options, rollout, say)

    # ---- loop ----------------------------------------------------------------------------------
    stop, stopped_at = StopRequest(), None
    if held_out and config.eval_at_start and start_step == 0:  # the baseline of every curve
        with logger.phase("eval"):
            logger.log_scalars(0, held_out.run(0, state, logger, log.summary))
    pending = None  # the step dispatched last, finished (logged) after the next dispatch
    last_data_state = None  # the data iterator's state after the last step dispatched
    # Each step's model FLOPs as MaxText counts them, for the MFU the log prints on a GPU.
    trained, llm = step_flops.Trained.of_split(start.split), start.model_config.llm
    # Each step's samples, read rollout_lookahead steps early (step_samples.py).
    queue = SampleQueue(
        data, accum * program.local_per_micro, rollout.lookahead, config.total_steps
    )
    for step in range(start_step, config.total_steps):
        with logger.phase("data"):
            taken = queue.take(step)
        sampled = rollout.sample(state, taken, queue.upcoming())  # packed while the last runs
        with logger.phase("pack"):  # offline: the cache read too
            packed = program.batches.pack(step, taken.samples, sampled.own, sampled.own_logprobs)
        with logger.phase("step"):  # dispatched, not awaited
            state, metrics = program.compiled[packed.bucket](state, packed.batch)
        scalars = dict(packed.scalars, **taken.data_metrics, **sampled.scalars)
        flops = step_flops.step_model_flops(
            config.mode,
            start.model_config,
            packed.counts,
            trained,
            remat=llm.remat,
            vit_remat=llm.vit_remat,
            teacher_config=start.teacher_flops_config,
        )
        tokens, model_flops = distributed.all_processes([packed.tokens, flops.model]).sum(axis=0)
        done = DispatchedStep(
            step=step + 1,
            metrics=metrics,
            scalars=scalars,
            pids=[s.pid for s in taken.samples],
            tokens=int(tokens),
            model_flops=float(model_flops),
            data_state=taken.data_state,
            completion=sampled.first(),
        )
        if pending is not None:
            log.finish(pending, state)
        pending, last_data_state = done, done.data_state
        if held_out.due(step + 1):
            with logger.phase("eval"):  # logged with the step, when it is finished
                done.eval_scalars.update(held_out.run(step + 1, state, logger, log.summary))
        # A signal during the last step: the run is done all the same (saved, the done line).
        stopping = stop.requested() and step + 1 < config.total_steps
        if checkpointer.should_save(step + 1) or step + 1 == config.total_steps or stopping:
            log.save(done, state)
        if stopping:
            checkpointer.wait_until_finished()
            log.finish(pending, state, flush=True)  # its window, not lost to the resume
            pending = None
            say(
                f"stopped by {stop.signal_name or 'a signal to another process'} after step "
                f"{step + 1}: checkpoint saved in {checkpoint_dir}; run the same command to resume"
            )
            stopped_at = step + 1
            break
    if pending is not None:
        log.finish(pending, state)

    close(logger, log.summary, stopped_at, last_data_state)


@dataclasses.dataclass
class OpenedCheckpoints:
    """The run's checkpointer, once main has opened it: the line a disk error ends the run with
    names its last complete step (and how to resume from it)."""

    checkpointer: Checkpointer | None = None
    auto_resume: bool = True  # the same command resumes (else resume_from is needed)


# Errors in what the user gave (files, directories, checkpoints): one line, no traceback. A
# traceback is kept for anything else, which is a bug to report.
USER_ERRORS = (
    HFCheckpointError,
    SafetensorsError,
    CheckpointError,
    sources.DataError,
    offline_cache.CacheError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    step_log.TooManyBadSteps,  # a stop the config asked for (max_consecutive_bad_steps)
)


def one_line_error(error: Exception, opened: OpenedCheckpoints) -> str | None:
    """The line `error` ends the run with, or None for a bug (its traceback is kept): an error
    in what the user gave, in the project's words; an error the OS reported (a full disk, a
    read-only or vanished mount), however orbax wrapped it, as `disk_error_line`."""
    if isinstance(error, USER_ERRORS) and getattr(error, "errno", None) is None:
        return str(error)
    disk_error = disk_errors.os_error_in(error)
    return None if disk_error is None else disk_error_line(disk_error, opened)


def disk_error_line(error: OSError, opened: OpenedCheckpoints) -> str:
    """`<file>: <reason>`, the checkpoint step it was saving if it was one, and the last
    complete checkpoint to resume from, read from the disk once the save in flight (if any)
    has finished or failed. A half-written step is never restored, so nothing saved is lost."""
    line = f"{error.filename or 'a file of the run'}: {error.strerror or error}"
    if isinstance(error, CheckpointWriteError) and error.step is not None:
        line += f", saving checkpoint step {error.step} (left incomplete: never restored)"
    checkpointer = opened.checkpointer
    if checkpointer is None:  # before the run opened its checkpoints: nothing to resume
        return line
    with contextlib.suppress(OSError):  # that save failed too: the disk says what is complete
        checkpointer.wait_until_finished()
    steps = checkpointer.all_steps()
    fix = "free space" if error.errno in (errno.ENOSPC, errno.EDQUOT) else "fix that"
    if not steps:
        return (
            f"{line}. No complete checkpoint in {checkpointer.directory} yet; {fix} and run the "
            f"same command to start again"
        )
    last = checkpointer.directory / str(steps[-1])
    resume = (
        "run the same command to resume from it"
        if opened.auto_resume
        else f"resume from it with --config.resume_from={last}"
    )
    return f"{line}. Last complete checkpoint: step {steps[-1]}, {last}; {fix} and {resume}"


def exit_with_one_line(line: str, code: int) -> NoReturn:
    """Print the run's last line on stderr and exit with `code`; nothing else reaches stderr
    from here on. After a failed save, orbax's abandoned threads and write coroutines are torn
    down when the process ends, and each repeats the error in a traceback or a warning (even a
    garbage collection that an allocation here sets off can print one): stderr is sent to
    /dev/null first, garbage collection stopped, and the line written to a copy of it."""
    gc.disable()
    sys.stdout.flush()
    sys.stderr.flush()
    stderr = os.dup(2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    os.write(stderr, (line + "\n").encode())
    sys.exit(code)


# Python's cyclic collector at a tracer's pace: tracing and lowering the run's programs allocate
# millions of short-lived containers, and at the default first threshold (700) every few hundred
# of them start a collection, now and then one that rescans the imported modules' objects. Those
# live as long as the process, so they are frozen out of every scan, and the first threshold is
# raised. A tiny smoke start with every program in the compilation cache (2026-12-06): the
# collector's own CPU time 1.12-1.45 s -> 0.46-0.50 s (timed with gc.callbacks; what is left
# runs during the imports, before this), the whole start 0.870x the CPU time of the defaults
# (farm-bench, median of 8 pairs; 1.011x in another call of 5, on a noisy machine).
COLLECTOR_THRESHOLD = 20_000


def tune_the_collector() -> None:
    """Freeze what the imports left (a collection first, so no garbage is frozen) and raise the
    collector's first threshold (the others are left as they are)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(COLLECTOR_THRESHOLD)


def stop_before_the_loop(signum, frame) -> NoReturn:
    """SIGTERM before the loop (a preemption during the load or a compile): as a Ctrl-C there,
    one line and exit 130 through sys.exit, so the run lock is released (atexit); Python's
    default would end the process at once and leave the lock behind. The loop's StopRequest
    takes the signal over (stop after the current step, save, exit 0)."""
    raise KeyboardInterrupt


def run(argv) -> None:
    tune_the_collector()
    signal.signal(signal.SIGTERM, stop_before_the_loop)
    opened = OpenedCheckpoints()
    try:
        main(argv, opened)
    except Exception as e:
        line = one_line_error(e, opened)
        if line is None:
            raise  # a bug: its traceback, to report
        exit_with_one_line(f"train.py: error: {line}", 1)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM before the loop, or a second Ctrl-C in it
        print(
            "train.py: interrupted; nothing more was saved (the same command resumes from the "
            "newest complete checkpoint, if there is one)",
            file=sys.stderr,
        )
        sys.exit(130)


if __name__ == "__main__":
    app.run(run, flags_parser=run_config.parse_flags)

"""train.py's stages: `main` there is the sequence, each stage an object here, one idea a file.

- start.py: the start state, fresh or resumed (`open_start` -> `Start`: the model, tokenizer and
  train state, from the HF files, a random init or a checkpoint);
- step_program.py: this process's share of a step, its micro-batches per mode and the train
  step compiled for every length bucket before step 1 (`compile_steps` -> `StepProgram`);
- rollout.py: everything the run samples with (`Rollout`: the decode layout, the decode copy,
  the engine, the lookahead's staleness bound); SFT and offline get one that samples nothing;
- step_samples.py: each step's samples, read rollout_lookahead steps early (`SampleQueue`);
- held_out.py: the held-out evaluation every eval_every steps (`HeldOut`);
- step_log.py: a dispatched step logged once the next one runs, non-finite steps counted, the
  checkpoint saves (`StepLog`, `DispatchedStep`, `TooManyBadSteps`);
- run_end.py: how a run ended and its closing lines (`RunEnd`, `close_run`, `next_commands`).

The packages' top layer: it imports from every other (pyproject.toml [tool.importlinter]).
"""

"""The paper's benchmarks, in process: VLMEvalKit's TSV files read (tsv.py), prompted as its
harness prompts them (prompts.py), decoded by the trainer's sampler and scored without an LLM
judge (scoring.py), with the datasets of each of the nine in registry.py and the loop and its
table in run.py."""

"""Everything that crosses the disk: the BAGEL HF layout (mapping, loading, export), safetensors,
the tokenizer, fresh weights for a run, and the orbax training checkpoints."""

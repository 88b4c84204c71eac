"""On-policy sampling: the batched KV-cache decode loop and the bf16 decode copy it runs on."""

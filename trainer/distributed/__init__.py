"""Sessions sharded with FSDP2 across the ranks of a `torchrun` job, driven from rank 0.

Design notes: `docs/design/distributed.md`.
"""

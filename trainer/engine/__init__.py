"""A model resource and its training sessions: atomic operations at any world size.
`resource` loads a base and owns its sessions and schedulers, `session` runs one session's
operations, `generator` the interface it samples through and its weights-sync and sample
operations, `in_process` the generator on the resource's model, `batching/` runs many LoRA
sessions' calls as one pass or one generation, `moe_replay_keys` stores routing-replay keys.

It imports `trainer.contract`, `trainer.compute` and `trainer.checkpoint`; never
`trainer.distributed`, `trainer.serving` or `trainer.api`.
"""

"""The Tinker API under `/api/v1`, so the `tinker` SDK and tinker-cookbook run unchanged, over
the same worker as the RL face.

It imports `trainer.serving` and the shared HTTP helpers of `trainer.api`; never `api.rl`.
"""

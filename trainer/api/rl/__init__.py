"""The hosted RL session API under `/v1`, as the together SDK speaks it: resources and
checkpoints (`routes_resources`), training sessions (`routes_sessions`), operations derived
from the operation table (`routes_ops`) and worker metrics (`routes_metrics`).

It imports `trainer.serving` and the shared HTTP helpers of `trainer.api`; never the Tinker face.
"""

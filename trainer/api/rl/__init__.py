"""The hosted RL session API under /v1, as the together SDK speaks it."""

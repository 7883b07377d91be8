"""The Fireworks training SDK's control plane (`/v1/accounts/...`: accounts, RLOR trainer
jobs, their checkpoints and promotion, models, training shapes) and the per-job gateway to
the Tinker face (`/training/v1/rlorTrainerJobs/{account}/{job}/api/v1/*`). A job is a model
resource of the engine; docs/semantics.md "Fireworks trainer jobs" states the rules."""

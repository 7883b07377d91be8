"""The worker's Tinker face: the Tinker REST API under `/api/v1`, so the `tinker` SDK and
tinker-cookbook run unchanged, over the same engine as the Together API."""

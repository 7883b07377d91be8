"""RL recipes on top of the worker's API: the GRPO loop, its tasks and its client.

Data path, one file per role:
    config.py      the typed recipe (a TOML file in configs/)
    tasks.py       verifiable tasks: prompts on the fly, rewards from a checker
    advantages.py  group-normalised advantages (pure functions)
    loop.py        sample → reward → advantages → forward-backward → optim-step → weights-sync
    client.py      the narrow client the loop drives: the official SDK over HTTP (production)
                   or an in-process session (tuning and unit tests only)
The demo's tiny model is `ModelConfig.tiny_spec()`, built by `trainer.tiny`.
"""

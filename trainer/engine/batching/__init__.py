"""Many LoRA sessions, one pass: a call as the pass sees it (`work`), the flat combiner
(`combine`), which calls may share a pass or a generation batch (`eligibility`), the scheduler
of forward(-backward) calls (`pass_scheduler`), the pass itself (`train_pass`) and how it runs
the model (`pass_forward`), and concurrent samples as one generation batch (`sample_batch`).
Part of the engine; same imports.
"""

"""Many LoRA sessions, one pass: the flat combiner (`combine`), which concurrent calls share a
forward(-backward) pass (`pass_scheduler`) and the pass itself (`train_pass`), and concurrent
samples as one generation batch (`sample_batch`). Part of the engine; same imports.
"""

"""Many LoRA sessions in one pass: the flat combiner and the schedulers."""

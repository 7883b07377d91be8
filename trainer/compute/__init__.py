"""Torch on one loaded model: loading, batches, logprobs, losses, policies, optimizers, decoding."""

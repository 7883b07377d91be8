"""A model resource and its training sessions: atomic operations at any world size."""

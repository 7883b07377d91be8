"""Durable state on disk: verified files, the atomic store, the checkpoint layouts."""

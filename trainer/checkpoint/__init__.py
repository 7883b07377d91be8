"""Durable state on disk: verified safetensors files (`files`), the atomic checkpoint store
and its catalogue (`store`), what a checkpoint holds and how it is read back (`layout`), and an
inference checkpoint as a full-weight resource's base (`base_weights`).

It imports `trainer.contract` and `trainer.compute`, never the engine: the layout sees a
session only through its own `SessionState` protocol.
"""

"""What crosses the engine's edge: request, sample and loss specs (`specs`, with the loss
registry `LOSS_SPECS`), scalar bounds (`values`), packed arrays (`arrays`), optimizer settings
(`optimizer`, `muon_params`), the engine's knobs (`options`) and `OperationError` (`errors`).

Pydantic and numpy only: it imports nothing else of `trainer`. Shape suffixes used across the
code are listed in `docs/semantics.md` (glossary).
"""

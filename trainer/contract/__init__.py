"""What crosses the engine's edge: request and sample specs (`specs`, on the bases of `base`),
the loss registry (`losses`: every loss, its params and the inputs it reads), the rulebook of a
request's content (`rules`, run by the HTTP edge, the engine and the Tinker face), scalar bounds
(`values`), packed arrays (`arrays`), the optimizer's settings (`optimizer`), the engine's knobs
(`options`) and `OperationError` (`errors`).

Pydantic and numpy only: it imports nothing else of `trainer`. Shape suffixes used across the
code are listed in `docs/semantics.md` (glossary).
"""

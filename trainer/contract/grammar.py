"""What a sample's text must match (docs/semantics.md §17.2): a JSON Schema, a GBNF grammar or
an llguidance Lark grammar, held as text. The faces read it off their wire (the Fireworks SDK's
`response_format`, or a chat's forced tool calls); the decode loop compiles it against the
model's tokenizer (`trainer/compute/grammar.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GrammarKind = Literal["json_schema", "gbnf", "lark", "llguidance"]


@dataclass(frozen=True)
class OutputGrammar:
    """`text`: a JSON Schema as JSON text (`json_schema`), the grammar's GBNF or Lark, or
    llguidance's own JSON of several grammars, one referring to others (`llguidance`). `field`:
    the request field it came from, which an error names."""

    kind: GrammarKind
    text: str
    field: str = "response_format"

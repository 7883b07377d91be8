"""The two bases of every pydantic spec in `trainer.contract`: wire objects and config files."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Spec(BaseModel):
    """Base for wire objects: unknown fields are ignored (the SDK may send newer ones), and
    types are strict: a boolean is a JSON boolean and a number a JSON number ("1", "yes", 1
    for true and 1.5 for an integer are refused). The int64 fields protobuf's JSON sends as
    decimal strings take them through `trainer.contract.values.IntLike`."""

    model_config = ConfigDict(extra="ignore", frozen=False, populate_by_name=True, strict=True)


class StrictSpec(BaseModel):
    """Base for config files: an unknown key is a typo and is refused."""

    model_config = ConfigDict(extra="forbid")

"""The two bases of every pydantic spec in `trainer.contract`: wire objects and config files."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Spec(BaseModel):
    """Base for wire objects: unknown fields are ignored (the SDK may send newer ones)."""

    model_config = ConfigDict(extra="ignore", frozen=False, populate_by_name=True)


class StrictSpec(BaseModel):
    """Base for config files: an unknown key is a typo and is refused."""

    model_config = ConfigDict(extra="forbid")

"""`MuonParams` under its own module name; it is defined with the rest of the optimizer's
settings in `trainer.contract.optimizer`."""

from __future__ import annotations

from trainer.contract.optimizer import MuonParams as MuonParams

"""The Fireworks face's state: its records, jobs and catalogue, one per app
(`app.state.fireworks`)."""

from __future__ import annotations

from trainer.api.fireworks.catalog import Catalog
from trainer.api.fireworks.jobs import JobService
from trainer.api.fireworks.records import FireworksRecords
from trainer.api.keys import KeyRing
from trainer.api.tinker.bridge import TinkerBridge
from trainer.serving.worker import Worker


class FireworksFace:
    def __init__(self, worker: Worker, keys: KeyRing, bridge: TinkerBridge) -> None:
        self.keys = keys
        self.records = FireworksRecords(worker.config.storage / "fireworks.sqlite")
        self.jobs = JobService(worker, self.records)
        self.catalog = Catalog(self.jobs, bridge.db)

    def close(self) -> None:
        """At shutdown, after the worker stopped the jobs' resources (they read PAUSED on the
        next start)."""
        self.records.close()

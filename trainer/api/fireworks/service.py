"""The Fireworks face's state: its records, jobs, catalogue, deployments and the resolvers of
completion models, one per app (`app.state.fireworks`)."""

from __future__ import annotations

from trainer.api.fireworks.catalog import Catalog
from trainer.api.fireworks.completion_batch import Merger
from trainer.api.fireworks.deployments import DeploymentService
from trainer.api.fireworks.jobs import JobService
from trainer.api.fireworks.records import FireworksRecords
from trainer.api.fireworks.targets import Targets
from trainer.api.keys import KeyRing
from trainer.api.tinker.bridge import TinkerBridge
from trainer.serving.worker import Worker


class FireworksFace:
    def __init__(self, worker: Worker, keys: KeyRing, bridge: TinkerBridge) -> None:
        self.keys = keys
        self.records = FireworksRecords(worker.config.storage / "fireworks.sqlite")
        self.jobs = JobService(worker, self.records)
        self.catalog = Catalog(self.jobs, bridge.db)
        self.bridge = bridge
        self.deployments = DeploymentService(worker, self.records, bridge)
        self.targets = Targets()  # completions' `model` -> engine session (`targets.py`)
        self.merger = Merger()  # concurrent completions of a target, one call (completion_batch)
        self.targets.register(self.deployments.resolve)  # accounts/<a>/deployments/<d>
        self.deployments.restore()  # READY again, re-hot-loaded in the background

    def close(self) -> None:
        """At shutdown, after the worker stopped the jobs' resources (they read PAUSED on the
        next start)."""
        self.deployments.close()
        self.records.close()

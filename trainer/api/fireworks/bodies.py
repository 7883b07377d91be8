"""The RLOR trainer job's create body, in the SDK's camelCase (`TrainerJobManager.
_build_trainer_create_payload`, seed 003), and the wire forms of times and durations.

Every field either SDK line sends, and every field of the seed's `RlorTrainerJob`, is known;
an unknown field, or a known one of the wrong type, is a 400 naming it
(`trainingConfig.loraRank`). Infrastructure fields (`region`, `acceleratorType`, `nodeCount`,
reservations, images, ...) are stored and echoed and change nothing on this worker.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

JOB_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
"""A job id: what the SDK generates (`training-api-service-<8hex>`) and Fireworks resource ids
allow (lowercase letters, digits and '-', at most 63)."""
MODEL_ID = JOB_ID
DURATION = re.compile(r"^(\d{1,9})(\.\d{1,9})?s$")


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TrainingConfig(Wire):
    baseModel: str = Field(min_length=1, max_length=512)
    loraRank: int = Field(default=0, ge=0, le=4096)
    learningRate: float = Field(default=1e-5, ge=0)
    maxContextLength: int | None = Field(default=None, ge=1)
    projectionHeadDim: int | None = Field(default=None, ge=0)
    customImageTag: str | None = Field(default=None, max_length=512)
    acceleratorType: str | None = Field(default=None, max_length=128)
    acceleratorCount: int | None = Field(default=None, ge=0)
    region: str | None = Field(default=None, max_length=128)
    extraArgs: list[str] | None = None
    gradientAccumulationSteps: int | None = Field(default=None, ge=0)
    epochs: int | None = Field(default=None, ge=0)
    batchSize: int | None = Field(default=None, ge=0)

    @field_validator("projectionHeadDim")
    @classmethod
    def _no_projection_head(cls, value: int | None) -> int | None:
        """Not served (the Tinker face's create_model refuses it too): refused here, so no
        job is made for a model that cannot then be created on it."""
        if value:
            raise ValueError("a train-only projection head is not served; omit it or send 0")
        return value


class CreateJobBody(Wire):
    trainingConfig: TrainingConfig
    serviceMode: bool = True  # LoRA included: the SDK always sends true (docs/decisions.md)
    keepAlive: bool = False
    dataset: str = Field(default="", max_length=1024)
    evaluationDataset: str | None = Field(default=None, max_length=1024)
    evalAutoCarveout: bool | None = None
    displayName: str | None = Field(default=None, max_length=256)
    nodeCount: int | None = Field(default=None, ge=0)
    trainerReplicaCount: int | None = Field(default=None, ge=0)
    useReservation: bool | None = None
    reservationTarget: str | None = Field(default=None, max_length=512)
    hotLoadDeploymentId: str | None = Field(default=None, max_length=512)
    rolloutDeploymentName: str | None = Field(default=None, max_length=512)
    extraValues: dict[str, str] | None = None
    forwardOnly: bool = False
    purpose: str | None = Field(default=None, max_length=128)
    usePurpose: str | None = Field(default=None, max_length=128)
    preemptible: bool | None = None
    managedBy: str | None = Field(default=None, max_length=512)
    inactivityTimeout: str | None = None
    disableInactivityCleanup: bool | None = None
    rewardWeights: list[str] | None = None
    # output fields a client may send back (a GET's body reposted): read and ignored
    name: str | None = None
    state: str | None = None
    createTime: str | None = None
    updateTime: str | None = None
    completedTime: str | None = None
    createdBy: str | None = None
    status: dict[str, Any] | None = None
    acceleratorSeconds: dict[str, Any] | None = None
    directRouteHandle: str | None = None

    @field_validator("inactivityTimeout")
    @classmethod
    def _duration(cls, value: str | None) -> str | None:
        if value is not None and not DURATION.fullmatch(value):
            raise ValueError("must be a protobuf JSON duration such as '1800s'")
        return value

    def echoed(self) -> dict[str, Any]:
        """What a job answers with of its create body: the fields sent, output ones left out."""
        out = self.model_dump(
            exclude_none=True,
            exclude={
                "name",
                "state",
                "createTime",
                "updateTime",
                "completedTime",
                "createdBy",
                "status",
                "acceleratorSeconds",
                "directRouteHandle",
            },
        )
        return out


class PromoteBody(BaseModel):
    """`POST /v1/accounts/{a}/checkpoints/{c}:promote` (snake_case, as the SDK sends it)."""

    model_config = ConfigDict(extra="forbid")

    output_model: str = Field(min_length=1, max_length=512)
    trainer_job_id: str | None = Field(default=None, max_length=512)
    base_model: str = Field(min_length=1, max_length=512)
    hot_load_deployment_id: str | None = Field(default=None, max_length=512)
    async_promotion: bool | None = None  # answered synchronously either way


def seconds_of(duration: str) -> float:
    match = DURATION.fullmatch(duration)
    assert match is not None
    return float(match.group(1) + (match.group(2) or ""))


def rfc3339(t: float | None) -> str | None:
    """Microsecond RFC 3339 in UTC (`2026-12-03T13:40:00.123456Z`): the cookbook compares
    `createTime` strings with its own `isoformat()` stamps."""
    if t is None:
        return None
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

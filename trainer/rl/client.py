"""The narrow interface the RL loop drives, and its two implementations.

- `HttpClient`: the production path. The official `together` SDK (unchanged) talking to a
  worker over HTTP, exactly as a user's script would.
- `LocalClient`: the same calls on an in-process `TrainingSession`, with no server. Only for
  fast recipe tuning and for unit tests of the loop's bookkeeping; the demo never uses it.

Both take and return wire-shaped data (sample dicts in, parsed `Completion`s out), so the loop
cannot tell them apart.
"""

from __future__ import annotations

import contextlib
import io
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

SYNCHRONOUS = "WEIGHT_SYNC_TYPE_SYNCHRONOUS"
BACKGROUND_PUBLISH = "WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH"


@dataclass
class Completion:
    """One sampled completion: its tokens, the sampler's logprobs and the policy versions."""

    tokens: list[int]
    logprobs: list[float]
    versions: list[int]  # policy version that produced each token (from policy_segments)
    stop_reason: str

    @property
    def version(self) -> int:
        """The oldest version that produced any of its tokens (what staleness counts from)."""
        return min(self.versions) if self.versions else 0


def token_versions(segments: list[dict[str, Any]], length: int) -> list[int]:
    """Expand `policy_segments` [{start_token, version}, ...] into one version per token."""
    ordered = sorted(segments, key=lambda s: int(s["start_token"]))
    out = []
    for i in range(length):
        current = [int(s["version"]) for s in ordered if int(s["start_token"]) <= i]
        out.append(current[-1] if current else int(ordered[0]["version"]))
    return out


def parse_results(results: list[dict[str, Any]]) -> list[list[Completion]]:
    """Wire `results` (one per prompt) → completions grouped by prompt."""
    groups = []
    for result in results:
        segments = result.get("policy_segments") or [{"start_token": 0, "version": 0}]
        group = []
        for seq in result["sequences"]:
            tokens = [int(t) for t in seq["tokens"]]
            group.append(
                Completion(
                    tokens=tokens,
                    logprobs=[float(x) for x in seq.get("logprobs") or []],
                    versions=token_versions(segments, len(tokens)),
                    stop_reason=str(seq.get("stop_reason", "")),
                )
            )
        groups.append(group)
    return groups


class PolicyClient(Protocol):
    """What the loop needs from a worker; every method is one API operation."""

    def sample(
        self, prompts: list[list[int]], num_samples: int, sampling: dict[str, Any]
    ) -> list[list[Completion]]: ...

    def submit_sample(
        self, prompts: list[list[int]], num_samples: int, sampling: dict[str, Any]
    ) -> Future[list[list[Completion]]]:
        """Queue a sample on the worker now (before anything submitted later); collect later."""
        ...

    def forward_backward(
        self, samples: list[dict[str, Any]], loss: dict[str, Any], with_logprobs: bool
    ) -> dict[str, Any]: ...

    def optim_step(self, params: dict[str, Any]) -> dict[str, Any]:
        """`params`: the optim-step body, `{"adam_params": ...}` or `{"muon_params": ...}`."""
        ...

    def weights_sync(self, sync_type: str) -> int: ...

    def checkpoints(self) -> tuple[str, str]:
        """Save a training and an inference checkpoint; return their ids."""
        ...

    def close(self) -> None: ...


def _model_input(tokens: list[int]) -> dict[str, Any]:
    return {"chunks": [{"encoded_text": {"tokens": tokens}}]}


def _as_dict(obj: Any) -> dict[str, Any]:
    """SDK pydantic models → plain dicts (extras kept); dicts pass through."""
    if isinstance(obj, dict):
        return obj
    data: dict[str, Any] = obj.model_dump(mode="json", exclude_none=True)
    return data


# --------------------------------------------------------------------------------------------
# Production: the official SDK over HTTP
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[io.StringIO]:
    """The SDK prints status lines while it waits for READY/RUNNING; keep the demo readable."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        yield buffer


class HttpClient:
    """The `together` SDK's post_training clients against `base_url` (…/v1)."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        base_model: str,
        lora: bool,
        lora_config: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        display_name: str | None = None,
        interval: float = 0.02,
        optimizer_config: dict[str, Any] | None = None,
    ) -> None:
        from together import Together
        from together.post_training import ModelResourcesClient

        self.interval = interval
        with _quiet_stdout():
            self.resource = ModelResourcesClient.create(
                api_key=token,
                base_url=base_url,
                base_model=base_model,
                lora_enabled=lora,
                optimizer_config=optimizer_config,  # type: ignore[arg-type]
                inactive_timeout=3600,
                interval=0.1,
            )
            try:
                self.session = self.resource.create_session(
                    lora_config=lora_config if lora else None,  # type: ignore[arg-type]
                    metadata=metadata,  # type: ignore[arg-type]
                    display_name=display_name,
                    interval=0.1,
                )
            except BaseException:
                self.resource.stop(force=True)
                raise
        self.session_id = self.session.session_id
        self.raw = Together(api_key=token, base_url=base_url, max_retries=5)

    def sample(
        self, prompts: list[list[int]], num_samples: int, sampling: dict[str, Any]
    ) -> list[list[Completion]]:
        results = self.session.generator.sample_batch(
            [_model_input(p) for p in prompts],  # type: ignore[misc]
            num_samples=num_samples,
            sampling_params=sampling,  # type: ignore[arg-type]
            interval=self.interval,
        )
        return parse_results([_as_dict(r) for r in results])

    def submit_sample(
        self, prompts: list[list[int]], num_samples: int, sampling: dict[str, Any]
    ) -> Future[list[list[Completion]]]:
        """POST the sample now (the worker queues it in arrival order), poll in a thread."""
        operation = self.raw.post_training.operations.sample(
            self.session_id,
            idempotency_key=str(uuid.uuid4()),
            model_inputs=[_model_input(p) for p in prompts],  # type: ignore[misc]
            num_samples=num_samples,
            sampling_params=sampling,  # type: ignore[arg-type]
        )
        future: Future[list[list[Completion]]] = Future()

        def poll() -> None:
            try:
                current = operation
                while current.status not in (
                    "TRAINING_OPERATION_STATUS_COMPLETED",
                    "TRAINING_OPERATION_STATUS_FAILED",
                ):
                    time.sleep(self.interval)
                    current = self.raw.post_training.operations.retrieve_sample(
                        operation.id, session_id=self.session_id
                    )
                if current.status == "TRAINING_OPERATION_STATUS_FAILED":
                    raise RuntimeError(f"sample operation {current.id} failed: {current.error}")
                future.set_result(parse_results(self._sample_output(current)["results"]))
            except BaseException as exc:
                future.set_exception(exc)

        threading.Thread(target=poll, name="rl-sample-poll", daemon=True).start()
        return future

    def _sample_output(self, operation: Any) -> dict[str, Any]:
        output = _as_dict(operation.output)
        payload_id = output.get("payload_id")
        if payload_id:  # a large result went out by payload: fetch and merge it
            import httpx

            info = self.raw.post(
                f"/rl/training-sessions/{self.session_id}/payloads/{payload_id}/download-url",
                cast_to=object,
            )
            url = info["download_url"]  # type: ignore[index]
            output = {**output, **httpx.get(url, timeout=300).json()}
        return output

    def forward_backward(
        self, samples: list[dict[str, Any]], loss: dict[str, Any], with_logprobs: bool
    ) -> dict[str, Any]:
        result = self.session.trainer.forward_backward(
            samples=samples,  # type: ignore[arg-type]
            loss=loss,  # type: ignore[arg-type]
            return_loss_fn_outputs=with_logprobs,
            interval=self.interval,
        )
        return _as_dict(result)

    def optim_step(self, params: dict[str, Any]) -> dict[str, Any]:
        result = self.session.trainer.optim_step(**params, interval=self.interval)
        return _as_dict(result)

    def weights_sync(self, sync_type: str) -> int:
        result = self.session.trainer.weights_sync(
            weight_sync_type=sync_type,  # type: ignore[arg-type]
            interval=self.interval,
        )
        return int(result.weights_version)

    def checkpoints(self) -> tuple[str, str]:
        training = self.session.create_training_checkpoint(interval=self.interval)
        inference = self.session.create_inference_checkpoint(interval=self.interval)
        return training.id, inference.id

    def close(self) -> None:
        with _quiet_stdout():
            self.session.stop()
            self.resource.stop(force=True)
        self.raw.close()


# --------------------------------------------------------------------------------------------
# Tuning and tests only: the engine in process
# --------------------------------------------------------------------------------------------


class LocalClient:
    """The same operations on an in-process `TrainingSession` (no HTTP, no server)."""

    def __init__(
        self,
        model_dir: Path,
        storage: Path,
        *,
        name: str,
        lora: bool,
        lora_config: dict[str, Any] | None = None,
        device: str | None = None,
        max_seq_length: int = 256,
        max_batch_size: int = 1024,
        seed: int = 0,
        optimizer_config: dict[str, Any] | None = None,
    ) -> None:
        from trainer.checkpoint.store import CheckpointStore
        from trainer.contract.specs import LoraConfig, ModelEntry, ResourceSpec, SessionSpec
        from trainer.engine.resource import ModelResource

        entry = ModelEntry(
            name=name,
            location=str(model_dir),
            max_seq_length=max_seq_length,
            max_batch_size=max_batch_size,
        )
        spec = ResourceSpec(
            base_model=name, lora_enabled=lora, optimizer_config=optimizer_config or {"adam": {}}
        )
        self.resource = ModelResource(entry, spec, CheckpointStore(storage), device=device)
        session_spec = SessionSpec(lora_config=LoraConfig(**(lora_config or {})) if lora else None)
        self.session = self.resource.create_session(f"local-{seed}", session_spec)

    def sample(
        self, prompts: list[list[int]], num_samples: int, sampling: dict[str, Any]
    ) -> list[list[Completion]]:
        from trainer.contract.specs import ModelInput, SamplingParams

        out = self.session.sample(
            [ModelInput.model_validate(_model_input(p)) for p in prompts],
            num_samples=num_samples,
            sampling_params=SamplingParams.model_validate(sampling),
        )
        return parse_results(out["results"])

    def submit_sample(
        self, prompts: list[list[int]], num_samples: int, sampling: dict[str, Any]
    ) -> Future[list[list[Completion]]]:
        """In process, "queued first" is simply "run now": same order as the worker's queue."""
        future: Future[list[list[Completion]]] = Future()
        future.set_result(self.sample(prompts, num_samples, sampling))
        return future

    def forward_backward(
        self, samples: list[dict[str, Any]], loss: dict[str, Any], with_logprobs: bool
    ) -> dict[str, Any]:
        from trainer.contract.specs import LossConfig, Sample

        return self.session.forward_backward(
            LossConfig.model_validate(loss),
            [Sample.model_validate(s) for s in samples],
            return_loss_fn_outputs=with_logprobs,
        )

    def optim_step(self, params: dict[str, Any]) -> dict[str, Any]:
        from trainer.contract.muon_params import MuonParams
        from trainer.contract.specs import AdamParams

        adam, muon = params.get("adam_params"), params.get("muon_params")
        return self.session.optim_step(
            adam=None if adam is None else AdamParams.model_validate(adam),
            muon=None if muon is None else MuonParams.model_validate(muon),
        )

    def weights_sync(self, sync_type: str) -> int:
        return int(self.session.weights_sync(sync_type)["weights_version"])

    def checkpoints(self) -> tuple[str, str]:
        training = self.session.save_training_checkpoint()
        inference = self.session.save_inference_checkpoint()
        return training.id, inference.id

    def close(self) -> None:
        self.resource.close()

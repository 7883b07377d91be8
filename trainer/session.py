"""One training session: its policy, optimizer, counters and RNG, and its atomic operations.

Every operation validates its input before touching any state, runs under the resource lock
(one GPU, many LoRA sessions), and either completes or leaves no trace:
- forward-backward computes new gradients apart from the accumulated ones and adds them only
  when loss and gradients are finite;
- optim-step checks the gradient norm before AdamW touches a weight;
- a checkpoint is listed only once complete (see `checkpoints.py`);
- any operation that raises gets back the RNG state, step and versions (pending publish
  included) it started with, and its registered undo actions run (`_running`); a sample
  swaps a pending publish back out of the generator that way (`session_generator.py`).

Each session has its own RNG state (LoRA dropout, sampling without a seed): it is swapped in
for the session's operations only, so interleaved sessions do not perturb each other and a
resumed session continues bit for bit.
"""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.batch import MicroBatch, PreparedSample, loss_norm, pack, prepare_samples
from trainer.checkpoints import INFERENCE, TRAINING, CheckpointRecord, save_tensors, write_json
from trainer.errors import OperationError, invalid
from trainer.logprobs import batch_logprobs
from trainer.losses import LossInputs, LossOutputs, compute_loss, custom_loss
from trainer.policy import Policy, cuda_devices, layout_like
from trainer.session_generator import GeneratorOps, Undo, Versions
from trainer.specs import (
    AdamParams,
    Gradient,
    LossConfig,
    Sample,
    SessionSpec,
)
from trainer.tracking import worker_run

if TYPE_CHECKING:
    from trainer.resource import ModelResource

CHECKPOINT_FORMAT = 1


@dataclass
class EngineOptions:
    row_tokens: int = 2048  # packing: tokens per packed row
    token_budget: int = 16384  # tokens per micro-batch
    chunk_tokens: int = 1024  # logprob head chunk
    activation_checkpointing: bool = False  # recompute decoder layers in the backward


@dataclass
class TrainingSession(GeneratorOps):
    resource: ModelResource
    id: str
    spec: SessionSpec
    policy: Policy
    rng_seed: int
    step: int = 0
    versions: Versions = field(default_factory=Versions)
    options: EngineOptions = field(default_factory=EngineOptions)
    training_checkpoints: list[CheckpointRecord] = field(default_factory=list)
    inference_checkpoints: list[CheckpointRecord] = field(default_factory=list)
    active: bool = True

    def __post_init__(self) -> None:
        params = list(self.policy.trainable.values())
        self.optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
        gen = torch.Generator().manual_seed(self.rng_seed)
        self._cpu_rng = gen.get_state()
        self._cuda_rng = [torch.cuda.get_rng_state(i) for i in cuda_devices()]
        self.tracker = worker_run(
            self.id, self.spec.metadata.model_dump(), str(getattr(self.resource.store, "root", "."))
        )

    # -- state -----------------------------------------------------------------------------

    def policy_state(self) -> dict[str, Any]:
        return self.versions.as_dict()

    @property
    def device(self) -> torch.device:
        return self.resource.device

    @contextlib.contextmanager
    def _running(self) -> Iterator[Undo]:
        """Resource lock + this session's RNG state swapped in for the operation. The RNG
        state is kept only if the operation completes; if it raises, step and versions (pending
        publish included) are put back and the undo actions it registered run in reverse."""
        if not self.active:
            raise OperationError("SESSION_NOT_ACTIVE", f"session {self.id} is not running")
        devices = cuda_devices()
        with self.resource.lock, torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self._cpu_rng)
            for i, state in zip(devices, self._cuda_rng):
                torch.cuda.set_rng_state(state, i)
            saved = (self.step, replace(self.versions))
            undo: Undo = []
            try:
                yield undo
            except BaseException:
                for action in reversed(undo):
                    action()
                self.step, self.versions = saved
                raise
            self._cpu_rng = torch.get_rng_state()
            self._cuda_rng = [torch.cuda.get_rng_state(i) for i in devices]

    def _prepare(
        self,
        samples: list[Sample],
        required: tuple[str, ...] = (),
        weights_are_mask: bool = True,
        gradients: list[Gradient] | None = None,
    ) -> list[PreparedSample]:
        entry = self.resource.entry
        return prepare_samples(
            samples,
            vocab_size=self.resource.vocab_size,
            max_seq_length=entry.max_seq_length,
            max_batch_size=entry.max_batch_size,
            required=required,
            weights_are_mask=weights_are_mask,
            gradients=gradients,
        )

    # -- forward / backward ----------------------------------------------------------------

    def forward_backward(
        self,
        loss: LossConfig,
        samples: list[Sample],
        *,
        forward_only: bool = False,
        return_loss_fn_outputs: bool = False,
    ) -> dict[str, Any]:
        """Part B §1–5. Returns {"loss", "metrics", "loss_fn_outputs"?}."""
        params = loss.params()
        is_ce = loss.type == "LOSS_TYPE_CROSS_ENTROPY"
        prepared = self._prepare(samples, loss.required_inputs, weights_are_mask=not is_ce)
        if loss.type == "LOSS_TYPE_GRPO" and getattr(params, "beta", 0.0) > 0:
            for s in prepared:
                if "reference_logprobs" not in s.inputs:
                    raise invalid(
                        f"samples[{s.index}].loss_fn_inputs.reference_logprobs",
                        "is required when grpo_params.beta > 0",
                    )

        def fn(inputs: LossInputs, _: MicroBatch) -> LossOutputs:
            return compute_loss(loss.type, inputs, params)

        result = self._run(prepared, fn, forward_only, return_loss_fn_outputs)
        if self.tracker is not None and not forward_only:
            metrics = {f"train/{k}": v for k, v in result["metrics"].items()}
            self.tracker.log(self.step, {"train/loss": result["loss"], **metrics})
        return result

    def custom_forward_backward(
        self, samples: list[Sample], gradients: list[Gradient]
    ) -> dict[str, Any]:
        """Backpropagate Σ_t m_t · g_t · lp_t with the client's per-token gradients g."""
        prepared = self._prepare(samples, gradients=gradients)

        def fn(inputs: LossInputs, batch: MicroBatch) -> LossOutputs:
            grads = batch.gather("gradients")
            assert grads is not None
            return custom_loss(inputs, grads.to(inputs.logprobs_N.device))

        self._run(prepared, fn, forward_only=False, return_outputs=False)
        return {}

    def _run(
        self,
        prepared: list[PreparedSample],
        fn: Callable[[LossInputs, MicroBatch], LossOutputs],
        forward_only: bool,
        return_outputs: bool,
    ) -> dict[str, Any]:
        norm = loss_norm(prepared)
        batches = self._pack(prepared)
        with self._running(), self.policy.training(train=not forward_only):
            stash = None if forward_only else self._stash_grads()
            try:
                result = self._run_batches(batches, norm, fn, forward_only, return_outputs)
                if not forward_only:
                    self._check_new_grads()
            except BaseException:
                if stash is not None:
                    self._restore_grads(stash)
                raise
            if stash is not None:
                self._merge_grads(stash)
        return result

    def _pack(self, prepared: list[PreparedSample]) -> list[MicroBatch]:
        """The micro-batches this process runs (all of the call's samples here)."""
        return pack(
            prepared, row_tokens=self.options.row_tokens, token_budget=self.options.token_budget
        )

    def _run_batches(
        self,
        batches: list[MicroBatch],
        norm: Any,
        fn: Callable[[LossInputs, MicroBatch], LossOutputs],
        forward_only: bool,
        return_outputs: bool,
    ) -> dict[str, Any]:
        total = 0.0
        sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        outputs: dict[int, list[float]] = {}
        for batch in batches:
            with torch.set_grad_enabled(not forward_only):
                logprobs_P, entropy_P = self._logprobs(batch, with_entropy=forward_only)
                inputs = self._loss_inputs(batch, logprobs_P, norm)
                try:
                    out = fn(inputs, batch)
                except ValueError as exc:
                    raise OperationError("INVALID_INPUT", str(exc)) from None
            if not torch.isfinite(out.loss):
                raise OperationError("NON_FINITE_LOSS", f"the loss is not finite ({out.loss})")
            if not forward_only and out.loss.requires_grad:
                out.loss.backward()
            total += float(out.loss.detach())
            add_metrics(sums, out.metrics, entropy_P)
            if return_outputs:
                self._collect_outputs(batch, logprobs_P.detach().float().cpu(), outputs)
        return call_result(total, sums, outputs if return_outputs else None, norm)

    def _logprobs(
        self, batch: MicroBatch, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return batch_logprobs(
            self.policy.model, batch, self.device, self.options.chunk_tokens, with_entropy
        )

    def _loss_inputs(self, batch: MicroBatch, logprobs_P: torch.Tensor, norm: Any) -> LossInputs:
        device = logprobs_P.device

        def get(name: str) -> torch.Tensor | None:
            value = batch.gather(name)
            return None if value is None else value.to(device)

        return LossInputs(
            logprobs_N=logprobs_P,
            sample_index_N=batch.sample_index_P.to(device),
            num_samples=len(batch.samples),
            mask_N=batch.mask_P().to(device),
            norm=norm,
            weights_N=get("weights"),
            sampler_logprobs_N=get("logprobs"),
            advantages_N=get("advantages"),
            reference_logprobs_N=get("reference_logprobs"),
        )

    @staticmethod
    def _collect_outputs(
        batch: MicroBatch, logprobs_P: torch.Tensor, outputs: dict[int, list[float]]
    ) -> None:
        offset = 0
        for sample in batch.samples:
            kept = sample.mask_T != 0
            n = int(kept.sum())
            full = torch.zeros(sample.length, dtype=torch.float32)
            full[kept] = logprobs_P[offset : offset + n]
            outputs[sample.index] = full.tolist()
            offset += n

    # -- gradients, kept apart until they are known to be finite ---------------------------

    def _stash_grads(self) -> dict[str, torch.Tensor | None]:
        stash = {}
        for name, param in self.policy.trainable.items():
            stash[name] = param.grad
            param.grad = None
        return stash

    def _check_new_grads(self) -> None:
        grads = [p.grad for p in self.policy.trainable.values() if p.grad is not None]
        if grads and not torch.isfinite(torch.nn.utils.get_total_norm(grads)):
            raise OperationError("NON_FINITE_LOSS", "the gradient is not finite")

    def _restore_grads(self, stash: dict[str, torch.Tensor | None]) -> None:
        for name, param in self.policy.trainable.items():
            param.grad = stash[name]

    def _merge_grads(self, stash: dict[str, torch.Tensor | None]) -> None:
        for name, param in self.policy.trainable.items():
            old = stash[name]
            if old is None:
                continue
            param.grad = old if param.grad is None else old.add_(param.grad)

    # -- optimizer -------------------------------------------------------------------------

    def optim_step(self, adam: AdamParams) -> dict[str, Any]:
        """AdamW (decoupled decay) with per-call knobs, global-norm clipping, then zero grads."""
        with self._running():
            params = list(self.policy.trainable.values())
            grads = [p.grad for p in params if p.grad is not None]
            norm = self._grad_norm(grads) if grads else 0.0
            if not torch.isfinite(torch.tensor(norm)):
                raise OperationError("NON_FINITE_LOSS", f"the gradient norm is {norm}")
            if adam.grad_clip_norm > 0 and grads:
                self._clip_grads(params, adam.grad_clip_norm, norm)
            clipped = min(norm, adam.grad_clip_norm) if adam.grad_clip_norm > 0 else norm
            for group in self.optimizer.param_groups:
                group.update(
                    lr=adam.learning_rate,
                    betas=(adam.beta1, adam.beta2),
                    eps=adam.eps,
                    weight_decay=adam.weight_decay,
                )
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            self.versions.trainer_step += 1
        metrics = {
            "grad_norm": norm,
            "grad_norm_clipped": clipped,
            "learning_rate": adam.learning_rate,
        }
        if self.tracker is not None:
            self.tracker.log(self.step, {f"optim/{k}": v for k, v in metrics.items()})
        return {
            "step": self.step,
            "metrics": metrics,
        }

    def _grad_norm(self, grads: list[torch.Tensor]) -> float:
        """The global L2 norm of the gradients (all of them, wherever they live)."""
        return float(torch.nn.utils.get_total_norm(grads))

    def _clip_grads(self, params: list[torch.nn.Parameter], max_norm: float, norm: float) -> None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.tensor(norm))

    # -- checkpoints -----------------------------------------------------------------------

    def save_training_checkpoint(self) -> CheckpointRecord:
        """Weights (adapter or full), AdamW state, counters, RNG states and specs. The files
        are written from the live tensors under the lock, with no copy-out (from an accelerator
        one tensor at a time); their fsync and sha256 finish once it is released (row 6)."""

        def writer(out: Path) -> None:
            with self._running():
                weights = {n: p.detach() for n, p in self.policy.trainable.items()}
                rng = {"cpu": self._cpu_rng.clone()}
                rng.update({f"cuda{i}": s.clone() for i, s in enumerate(self._cuda_rng)})
                # largest first: its sha256 starts while the others are written
                save_tensors(self._optimizer_tensors(copy=False), out / "optimizer.safetensors")
                save_tensors(weights, out / "weights.safetensors")
                save_tensors(rng, out / "rng.safetensors")
                write_json(out / "state.json", self._state_json())

        record = self._store(TRAINING, writer)
        self.training_checkpoints.append(record)
        return record

    def save_inference_checkpoint(self) -> CheckpointRecord:
        """LoRA: `adapter/` (PEFT) + `merged/`; full weights: `merged/`."""
        return self._write_inference()

    def _write_inference(self, source: Any = None) -> CheckpointRecord:
        """`source`: the model whose `state_dict()` is exported (default: the live one)."""
        state = self._state_json()

        def writer(out: Path) -> None:
            self.policy.export_inference(out, self.resource.tokenizer, source)
            write_json(out / "state.json", state)

        with self._running():
            record = self._store(INFERENCE, writer)
        self.inference_checkpoints.append(record)
        return record

    def _store(self, kind: str, writer: Callable[[Path], None], **meta: Any) -> CheckpointRecord:
        """Write a checkpoint of this session atomically and list it in the catalogue."""
        return self.resource.store.write(
            type=kind,
            session_id=self.id,
            step=self.step,
            base_model=self.resource.entry.name,
            lora_rank=self._lora_rank(),
            writer=writer,
            meta={"kind": self.policy.kind, **meta},
        )

    def _lora_rank(self) -> int | None:
        config = getattr(self.policy, "config", None)
        return None if config is None else int(config.rank)

    def _state_json(self) -> dict[str, Any]:
        config = getattr(self.policy, "config", None)
        return {
            "format": CHECKPOINT_FORMAT,
            "kind": self.policy.kind,
            "base_model": self.resource.entry.name,
            "step": self.step,
            "trainer_step": self.versions.trainer_step,
            "lora_config": None if config is None else config.model_dump(),
            "lora_seed": getattr(self.policy, "seed", None),
            "rng_seed": self.rng_seed,
            "session_spec": json.loads(self.spec.model_dump_json()),
            "resource_spec": json.loads(self.resource.spec.model_dump_json()),
        }

    def _optimizer_tensors(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """CPU copies, or (`copy=False`) the live state tensors, to be read under the lock."""
        out = {}
        for name, param in self.policy.trainable.items():
            state = self.optimizer.state.get(param)
            if not state:
                continue
            for key, value in state.items():
                value = value.detach()
                out[f"{name}::{key}"] = value.to("cpu", copy=True) if copy else value
        return out

    def load_optimizer_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        by_param: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
        for key, value in tensors.items():
            name, _, slot = key.rpartition("::")
            if name not in self.policy.trainable:
                raise ValueError(f"optimizer state names an unknown tensor {name}")
            by_param[name][slot] = value
        for name, state in by_param.items():
            param = self.policy.trainable[name]
            self.optimizer.state[param] = {
                slot: (v if slot == "step" else layout_like(param, v, cast=False))
                for slot, v in state.items()
            }

    def restore_rng(self, tensors: dict[str, torch.Tensor]) -> None:
        self._cpu_rng = tensors["cpu"].clone()
        for i in range(len(self._cuda_rng)):
            if f"cuda{i}" in tensors:
                self._cuda_rng[i] = tensors[f"cuda{i}"].clone()

    def close(self) -> None:
        with self.resource.lock:
            self.active = False
            self.optimizer.state.clear()
            for param in self.policy.trainable.values():
                param.grad = None
            self.policy.close()
            if self.tracker is not None:
                self.tracker.finish()
                self.tracker = None


def add_metrics(
    sums: dict[str, list[float]],
    metrics: dict[str, tuple[float, float]],
    entropy_P: torch.Tensor | None = None,
) -> None:
    """Add a micro-batch's (numerator, denominator) metrics, and its entropy, to the call's."""
    for name, (num, den) in metrics.items():
        sums[name][0] += num
        sums[name][1] += den
    if entropy_P is not None:
        sums["loss/entropy/mean"][0] += float(entropy_P.sum())
        sums["loss/entropy/mean"][1] += float(entropy_P.numel())


def call_result(
    total: float,
    sums: dict[str, list[float]],
    outputs: dict[int, list[float]] | None,
    norm: Any,
) -> dict[str, Any]:
    """The call's result from its summed loss, metric (numerator, denominator) pairs and
    per-sample logprobs."""
    metrics = {name: (num / den if den else 0.0) for name, (num, den) in sums.items()}
    metrics["loss/tokens"] = norm.total_mask
    result: dict[str, Any] = {"loss": total, "metrics": metrics}
    if outputs is not None:
        result["loss_fn_outputs"] = [
            {"tensors": {"logprobs": {"data": outputs[i], "dtype": "float32"}}}
            for i in sorted(outputs)
        ]
    return result

"""One training session: its policy, optimizer, counters and RNG, and its atomic operations.

Design notes: `docs/design/engine.md`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from trainer.checkpoint import layout
from trainer.checkpoint.export import AdapterExport
from trainer.checkpoint.store import INFERENCE, TRAINING, CheckpointRecord, write_json
from trainer.compute import optim
from trainer.compute.batch import MicroBatch, PreparedSample, check_rules, prepare_samples
from trainer.compute.losses import LossInputs, LossOutputs, custom_loss, pick_loss
from trainer.compute.moe_replay import routing_shape
from trainer.compute.muon import MuonWithAdamW, muon_step, new_muon
from trainer.compute.policy import LoraPolicy, Policy, cuda_devices
from trainer.compute.sampler import SampleWatch  # at run time: spmd reads the signature
from trainer.contract.embeddings import EmbeddingObjective
from trainer.contract.errors import OperationError, invalid
from trainer.contract.grammar import OutputGrammar
from trainer.contract.muon_params import MuonParams
from trainer.contract.optimizer import optimizer_kind
from trainer.contract.options import EngineOptions
from trainer.contract.rules import Limits
from trainer.contract.specs import (
    AdamParams,
    Gradient,
    LoraConfig,
    LossConfig,
    ModelInput,
    Sample,
    SamplingParams,
    SessionSpec,
    chunk_datums,
)
from trainer.engine.backends import generator_for
from trainer.engine.batching.embed_pass import embedding_call
from trainer.engine.batching.work import WorkItem
from trainer.engine.generator import Generator, Undo, Versions, sync_weights
from trainer.engine.grad_keeping import GradKeeping
from trainer.engine.moe_replay_keys import attach_routed_experts
from trainer.engine.tracking import worker_run

if TYPE_CHECKING:
    from trainer.compute.placement import Communicator
    from trainer.engine.handle import ResourceHandle


@dataclass
class TrainingSession(GradKeeping):
    # the operations a client queues, by method name: the serving layer's operation table
    # covers exactly these, and under torchrun every rank runs them (`distributed/spmd.py`)
    OPERATIONS: ClassVar[tuple[str, ...]] = (
        "forward_backward",
        "custom_forward_backward",
        "embedding_forward_backward",
        "optim_step",
        "weights_sync",
        "sample",
        "save_training_checkpoint",
        "save_inference_checkpoint",
    )
    # the operations that run as a forward(-backward) pass, shared with other sessions' calls
    # where they may (`work_item`)
    PASS_OPERATIONS: ClassVar[tuple[str, ...]] = ("forward_backward", "custom_forward_backward")

    resource: ResourceHandle
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
    # what the gradients accumulated since the last optimizer step were computed over
    # (`keep_grads`): tokens with m_t != 0, and samples with at least one (docs/semantics.md §23)
    accumulated_tokens: int = 0
    accumulated_sequences: int = 0
    generator: Generator = field(init=False, repr=False, compare=False)  # serves its samples

    def __post_init__(self) -> None:
        self.generator = generator_for(self.resource, self.policy, self.id)
        config = self.resource.spec.optimizer_config
        self.optimizer: torch.optim.Optimizer = (
            new_muon(
                self.policy.trainable,
                config["muon"]["scaling_strategy"],
                self.policy.expert_factors,  # LoRA on MoE experts
                masters=self.options.master_weights,
            )
            if optimizer_kind(config) == "muon"
            else optim.new_adamw(
                list(self.policy.trainable.values()), masters=self.options.master_weights
            )
        )
        # the session's RNG streams between operations (`operation_scope` swaps them in), all
        # drawn from its seed: the CPU's and each CUDA device's (dropout masks on a GPU)
        devices = cuda_devices(self.resource.device)
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.rng_seed)
            self.cpu_rng = torch.get_rng_state()
            self.cuda_rng = [torch.cuda.get_rng_state(i) for i in devices]
        self.tracker = worker_run(
            self.id, self.spec.metadata.model_dump(), str(self.resource.store.root)
        )

    # -- state -----------------------------------------------------------------------------

    def policy_state(self) -> dict[str, Any]:
        return self.versions.as_dict()

    @property
    def lora_config(self) -> LoraConfig | None:
        """The LoRA config it trains with (a resumed checkpoint's own); None: full weights."""
        return self.policy.config

    def restore_counters(self, step: int, trainer_step: int) -> None:
        """A resumed checkpoint's counters: the generator serves the weights it saved."""
        self.step = step
        self.versions = Versions(
            trainer_step=trainer_step,
            target_weights_version=trainer_step,
            applied_weights_version=trainer_step,
        )

    @property
    def device(self) -> torch.device:
        return self.resource.device

    @property
    def comm(self) -> Communicator:
        """The ranks this session runs on (one process: identities)."""
        return self.resource.comm

    @contextlib.contextmanager
    def operation_scope(self) -> Iterator[Undo]:
        """Resource lock + this session's RNG state swapped in for the operation. The RNG
        state is kept only if the operation completes; if it raises, step and versions (pending
        publish included) are put back and the undo actions it registered run in reverse."""
        if not self.active:
            raise OperationError("SESSION_NOT_ACTIVE", f"session {self.id} is not running")
        devices = cuda_devices(self.resource.device)
        with self.resource.lock, torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu_rng)
            for i, state in zip(devices, self.cuda_rng):
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
            self.cpu_rng = torch.get_rng_state()
            self.cuda_rng = [torch.cuda.get_rng_state(i) for i in devices]

    def _prepare(
        self,
        samples: list[Sample],
        required: tuple[str, ...] = (),
        weights_are_mask: bool = True,
        soft_targets: bool = False,
        gradients: list[Gradient] | None = None,
    ) -> list[PreparedSample]:
        entry = self.resource.entry
        prepared = prepare_samples(
            samples,
            vocab_size=self.resource.vocab_size,
            max_seq_length=entry.max_seq_length,
            max_batch_size=chunk_datums(entry.max_batch_size),  # the faces check theirs
            required=required,
            weights_are_mask=weights_are_mask,
            soft_targets=soft_targets,
            gradients=gradients,
        )
        attach_routed_experts(self, samples, prepared)  # MoE routing replay (docs/semantics.md §12)
        return prepared

    # -- forward / backward (the pass: `batching/train_pass.py`) -----------------------------

    def forward_backward(
        self,
        loss: LossConfig,
        samples: list[Sample],
        *,
        forward_only: bool = False,
        return_loss_fn_outputs: bool = False,
        logprobs_unmasked: bool = False,
    ) -> dict[str, Any]:
        """docs/semantics.md §1–§5. Returns {"loss", "metrics", "loss_fn_outputs"?}.

        `logprobs_unmasked` (the Tinker face): `loss_fn_outputs` hold lp_t at every position,
        masked ones included (docs/semantics.md §4 zeroes them otherwise); loss, gradients and
        metrics are unchanged."""
        options = (forward_only, return_loss_fn_outputs, logprobs_unmasked)
        return self._run(self._forward_backward_item(loss, samples, *options))

    def custom_forward_backward(
        self, samples: list[Sample], gradients: list[Gradient]
    ) -> dict[str, Any]:
        """Backpropagate Σ_t m_t · g_t · lp_t with the client's per-token gradients g."""
        return self._run(self._custom_forward_backward_item(samples, gradients))

    def embedding_forward_backward(
        self,
        samples: list[Sample],
        objective: EmbeddingObjective,
        forward_only: bool = False,
        gradients: list[Gradient] | None = None,
    ) -> dict[str, Any]:
        """docs/semantics.md §27: pooled hidden states, a forward's outputs or a backward."""
        entry, vocab = self.resource.entry, self.resource.vocab_size
        limits = Limits(entry.max_seq_length, chunk_datums(entry.max_batch_size), None, vocab)
        call = (samples, objective, forward_only, gradients)
        return embedding_call(self, limits, self.resource.hidden_size, *call)

    def _forward_backward_item(
        self,
        loss: LossConfig,
        samples: list[Sample],
        forward_only: bool,
        return_loss_fn_outputs: bool,
        logprobs_unmasked: bool,
    ) -> WorkItem:
        """`forward_backward`'s call, validated and prepared, not run yet."""
        spec, params = loss.spec, loss.params()
        prepared = self._prepare(
            samples,
            spec.required,
            weights_are_mask=spec.weights_are_mask,
            soft_targets=spec.soft_targets,
        )
        for sample in prepared:
            sample.keep_all = logprobs_unmasked
        check_rules(prepared, spec.rules_for(params))
        compute = pick_loss(loss.type, params)

        def fn(inputs: LossInputs, _: MicroBatch) -> LossOutputs:
            return compute(inputs)

        def after(result: dict[str, Any]) -> dict[str, Any]:
            if self.tracker is not None and not forward_only:
                metrics = {f"train/{k}": v for k, v in result["metrics"].items()}
                self.tracker.log(self.step, {"train/loss": result["loss"], **metrics})
            return result

        return WorkItem.of(self, prepared, fn, forward_only, return_loss_fn_outputs, after)

    def _custom_forward_backward_item(
        self, samples: list[Sample], gradients: list[Gradient]
    ) -> WorkItem:
        """`custom_forward_backward`'s call, validated and prepared, not run yet."""
        prepared = self._prepare(samples, gradients=gradients)

        def fn(inputs: LossInputs, batch: MicroBatch) -> LossOutputs:
            grads = batch.gather("gradients")
            assert grads is not None
            return custom_loss(inputs, grads.to(inputs.logprobs_P.device))

        return WorkItem.of(self, prepared, fn, False, False, lambda _: {})

    def work_item(self, op: str, kwargs: dict[str, Any]) -> WorkItem:
        """The call of pass operation `op` (one of `PASS_OPERATIONS`) with these keyword
        arguments, validated and prepared, not run yet: under torchrun every rank builds the
        calls of one grouped command this way, then runs their passes."""
        if op not in self.PASS_OPERATIONS:
            raise ValueError(f"{op!r} is not a pass operation")
        bound = inspect.signature(getattr(self, op)).bind(**kwargs)
        bound.apply_defaults()  # the operation's own defaults, as a direct call would take
        if op == "forward_backward":
            return self._forward_backward_item(**bound.arguments)
        return self._custom_forward_backward_item(**bound.arguments)

    def _run(self, item: WorkItem) -> dict[str, Any]:
        """Through the resource's scheduler: in a pass shared with other sessions' calls where
        it may (`batching/pass_scheduler.py`), else in a pass of its own."""
        self.resource.scheduler.run(item)
        return item.outcome()

    # -- optimizer -------------------------------------------------------------------------

    def optim_step(
        self,
        adam: AdamParams | None = None,
        muon: MuonParams | None = None,
        grad_accumulation_normalization: str | None = None,
    ) -> dict[str, Any]:
        """The resource's optimizer with per-call knobs (omitted: defaults): the accumulated
        gradients normalized (`grad_scale`), global-norm clipping, then AdamW (decoupled decay)
        or Muon + AdamW (`muon.py`), then zero grads and counts."""
        is_muon = isinstance(self.optimizer, MuonWithAdamW)
        if (adam if is_muon else muon) is not None:  # the route refuses it first, as a 400
            field = "adam_params" if is_muon else "muon_params"
            raise OperationError("INVALID_INPUT", f"{field}: not the resource's optimizer", field)
        with self.operation_scope():
            params = list(self.policy.trainable.values())
            scale = self.grad_scale(grad_accumulation_normalization)
            if isinstance(self.optimizer, MuonWithAdamW):
                metrics = muon_step(self.optimizer, params, muon or MuonParams(), self.comm, scale)
            else:
                metrics = optim.adamw_step(
                    self.optimizer, params, adam or AdamParams(), self.comm, scale
                )
            if grad_accumulation_normalization is not None:
                metrics["grad_accumulation_scale"] = scale
            self.accumulated_tokens = self.accumulated_sequences = 0
            self.step += 1
            self.versions.trainer_step += 1
        if self.tracker is not None:
            self.tracker.log(self.step, {f"optim/{k}": v for k, v in metrics.items()})
        return {
            "step": self.step,
            "metrics": metrics,
        }

    # -- the generator (`engine/generator.py`) --------------------------------------------

    def weights_sync(self, sync_type: str) -> dict[str, Any]:
        """SYNCHRONOUS: live on return. BACKGROUND_PUBLISH and PIPELINE: a snapshot is queued
        and the next sample applies it before generating (`pending_publish` until then)."""
        return sync_weights(self, sync_type)

    def sample(
        self,
        model_inputs: list[ModelInput],
        *,
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        return_routed_experts: bool = False,
        prompt_logprobs_last_n: int | None = None,
        sampling_logprobs: bool = False,
        target_prompt_ids: list[list[list[int]]] | None = None,
        prompt_alt_tokens_k: int = 0,
        watch: SampleWatch | None = None,
        return_routing_matrices: bool = False,
        grammar: OutputGrammar | None = None,
    ) -> dict[str, Any]:
        """`prompt_logprobs_last_n`: the Tinker face's; the RL session API never sends it.
        `watch`: a caller's view of the running generation (`sampler.SampleWatch`), never on
        a wire. `return_routing_matrices`: the completions face's; each sequence's routes
        inline (docs/semantics.md §12), refused on a dense model. `grammar`: what the
        samples' text must match (§17.2; the completions face's `response_format`)."""
        if return_routing_matrices and routing_shape(self.policy.model) is None:
            raise invalid(
                "return_routing_matrices",
                "this model has no mixture-of-experts layers: it has no routes to return",
            )
        call = self.generator.sample_call(
            model_inputs,
            num_samples,
            sampling_params or SamplingParams(),
            prompt_logprobs=prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            return_routed_experts=return_routed_experts,
            steps_per_turn=self.options.decode_steps_per_turn,
            prompt_logprobs_last_n=prompt_logprobs_last_n,
            sampling_logprobs=sampling_logprobs,
            target_prompt_ids=target_prompt_ids,
            prompt_alt_tokens_k=prompt_alt_tokens_k,
            watch=watch,
            return_routing_matrices=return_routing_matrices,
            grammar=grammar,
        )
        return self.generator.sample(self, call)

    # -- checkpoints (the layout: `checkpoint/layout.py`) -----------------------------------

    def save_training_checkpoint(self) -> CheckpointRecord:
        """Weights (adapter or full), AdamW state, counters, RNG states and specs. The files
        are written from the live tensors under the lock, with no copy-out (from an accelerator
        one tensor at a time); their fsync and sha256 finish once it is released (row 6)."""
        meta = {"world_size": self.comm.world_size} if self.comm.world_size > 1 else {}
        record = self._store(TRAINING, lambda out: layout.write_training(self, out), **meta)
        self.training_checkpoints.append(record)
        return record

    def save_inference_checkpoint(
        self,
        export: AdapterExport | None = None,
        merged: bool = False,
        precision: str | None = None,
        decision: dict[str, Any] | None = None,
    ) -> CheckpointRecord:
        """LoRA: `adapter/` (PEFT) + `merged/`; full weights: `merged/`. Sharded weights are
        gathered to rank 0, which writes; the other ranks' result is never read.

        With `export` (the Tinker face's `save_weights_external`; no RL-face operation sets
        it): `adapter/` alone, in the export's naming, encrypted to its age recipients
        (`checkpoint/export.py`), and nothing gathered. LoRA only. With `merged` (the
        Fireworks SDK's `merged_base`): refused while the adapter changes nothing; `merged/`
        is written at `precision` (`source`: the base model's stored dtype; `bf16`). With
        `decision`, a `decision.json` beside `state.json` holds it."""
        if export is not None and self.lora_config is None:
            raise OperationError(
                "INVALID_INPUT", "export: an adapter export needs a LoRA session", "export"
            )
        if merged:
            self._check_merge()
        source = None
        if export is None:
            with self.operation_scope():
                source = self.resource.placement.full_state(self.policy.model)
        if self.comm.rank != 0:
            return layout.placeholder_record()
        state = layout.state_json(self)
        dtype = None if precision is None else self.resource.export_dtype(precision)

        def writer(out: Path) -> None:
            if export is None:
                layout.write_inference(self.policy, out, self.resource.tokenizer, source, dtype)
            else:
                layout.write_export(self.policy, out, export)
            write_json(out / "state.json", state)
            if decision is not None:
                write_json(out / "decision.json", decision)

        meta = {} if export is None else {"export": export.meta()}
        with self.operation_scope():
            record = self._store(INFERENCE, writer, **meta)
        self.inference_checkpoints.append(record)
        return record

    def _check_merge(self) -> None:
        """A `merged_base` save folds the adapter into the base weights: a LoRA session only,
        and one whose adapter is not still zero (nothing trained or loaded), which would
        promote the base model itself under a new name."""
        policy = self.policy
        if not isinstance(policy, LoraPolicy):
            raise OperationError(
                "INVALID_INPUT",
                "checkpoint_type: merged_base folds a LoRA adapter; a full-weight session has none",
                "checkpoint_type",
            )
        if not self.comm.max_int(int(policy.delta_on_this_rank())):
            raise OperationError(
                "INVALID_INPUT",
                "checkpoint_type: merged_base of an adapter that is still zero (nothing trained "
                "or loaded) would be the base model itself; train or load_adapter first",
                "checkpoint_type",
            )

    def _store(self, kind: str, writer: Callable[[Path], None], **meta: Any) -> CheckpointRecord:
        """Write a checkpoint of this session atomically and list it in the catalogue."""
        return self.resource.store.write(
            type=kind,
            session_id=self.id,
            step=self.step,
            base_model=self.resource.entry.name,
            lora_rank=None if self.lora_config is None else int(self.lora_config.rank),
            writer=writer,
            meta={"kind": self.policy.kind, **meta},
        )

    def rng_tensors(self) -> dict[str, torch.Tensor]:
        """The session's RNG states as a checkpoint holds them (copies)."""
        rng = {"cpu": self.cpu_rng.clone()}
        rng.update({f"cuda{i}": s.clone() for i, s in enumerate(self.cuda_rng)})
        return rng

    def restore_rng(self, tensors: dict[str, torch.Tensor]) -> None:
        self.cpu_rng = tensors["cpu"].clone()
        for i in range(len(self.cuda_rng)):
            if f"cuda{i}" in tensors:
                self.cuda_rng[i] = tensors[f"cuda{i}"].clone()

    def close(self) -> None:
        with self.resource.lock:
            self.active = False
            self.optimizer.state.clear()
            self.optimizer.zero_grad(set_to_none=True)  # and the fp32 sums beside them
            self.generator.close()
            self.policy.close()
            if self.tracker is not None:
                self.tracker.finish()
                self.tracker = None

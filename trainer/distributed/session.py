"""`ShardedSession`: a training session whose operations run SPMD, data-parallel over ranks:
each rank takes its share of a call's samples, all run the same number of micro-batches, and
losses, metrics, finite checks and gradient norms are global."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.batch import MicroBatch, PreparedSample, pack
from trainer.checkpoints import TRAINING, CheckpointRecord, write_json
from trainer.distributed.comm import Comm, fault_point
from trainer.distributed.sharding import GatheredModel, gather_full_state, local_part, reshard
from trainer.errors import OperationError
from trainer.logprobs import token_logprobs
from trainer.losses import LossInputs, LossNorm, LossOutputs
from trainer.resource import SHARDED_DIR
from trainer.session import TrainingSession, add_metrics, call_result
from trainer.specs import (
    ModelInput,
    SamplingParams,
)

if TYPE_CHECKING:
    from trainer.distributed.resource import ShardedModelResource


def split_by_tokens(samples: list[PreparedSample], world_size: int) -> list[list[PreparedSample]]:
    """Balance tokens: longest first, each to the rank holding the fewest tokens so far."""
    shares: list[list[PreparedSample]] = [[] for _ in range(world_size)]
    tokens = [0] * world_size
    for sample in sorted(samples, key=lambda s: (-s.length, s.index)):
        rank = min(range(world_size), key=lambda r: (tokens[r], r))
        shares[rank].append(sample)
        tokens[rank] += sample.length
    return [sorted(share, key=lambda s: s.index) for share in shares]


def _merge_reports(
    reports: list[dict[str, Any]],
) -> tuple[float, dict[str, list[float]], dict[int, list[float]]]:
    """Sum the ranks' losses and metric (numerator, denominator) pairs, in rank order, and
    collect their per-sample outputs."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    outputs: dict[int, list[float]] = {}
    for report in reports:
        for name, (num, den) in report["sums"].items():
            sums[name][0] += num
            sums[name][1] += den
        outputs.update({int(k): v for k, v in report["outputs"].items()})
    return sum(float(report["loss"]) for report in reports), sums, outputs


def _dummy_batch() -> MicroBatch:
    """One masked token: runs every FSDP unit, contributes nothing."""
    one = torch.zeros(1, dtype=torch.long)
    sample = PreparedSample(index=0, tokens_T=one, targets_T=one, mask_T=torch.zeros(1))
    return pack([sample])[0]


def _sharded_logprobs(
    model: Any,
    tokens_R_L: torch.Tensor,
    position_ids_R_L: torch.Tensor,
    attention_mask_R_1_L_L: torch.Tensor,
    keep_index_P: torch.Tensor,
    targets_P: torch.Tensor,
    chunk_tokens: int,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`batch_logprobs` run inside the FSDP root, plus `link`: a zero that depends on every
    unit's parameters, so the backward reaches each unit even when no token is kept."""
    hidden = model.get_decoder()(
        input_ids=tokens_R_L,
        position_ids=position_ids_R_L,
        attention_mask=attention_mask_R_1_L_L,
        use_cache=False,
    ).last_hidden_state
    hidden_N_H = hidden.reshape(-1, hidden.shape[-1])
    head = model.get_output_embeddings()
    logprobs_P, entropy_P = token_logprobs(
        hidden_N_H[keep_index_P],
        head,
        targets_P,
        chunk_tokens=chunk_tokens,
        with_entropy=with_entropy,
    )
    if keep_index_P.numel() > 0:
        link = logprobs_P.sum() * 0.0
    else:
        first, _ = token_logprobs(hidden_N_H[:1], head, targets_P.new_zeros(1))
        link = first.sum() * 0.0
    return logprobs_P, entropy_P, link


class ShardedSession(TrainingSession):
    """A `TrainingSession` whose operations run SPMD on every rank of the job."""

    resource: ShardedModelResource

    @property
    def comm(self) -> Comm:
        return self.resource.comm

    @property
    def _sharded(self) -> bool:
        return any(isinstance(p, DTensor) for p in self.policy.trainable.values())

    # -- forward / backward ----------------------------------------------------------------

    def _pack(self, prepared: list[PreparedSample]) -> list[MicroBatch]:
        mine = split_by_tokens(prepared, self.comm.world_size)[self.comm.rank]
        return super()._pack(mine) if mine else []

    def _run_batches(
        self,
        batches: list[MicroBatch],
        norm: LossNorm,
        fn: Callable[[LossInputs, MicroBatch], LossOutputs],
        forward_only: bool,
        return_outputs: bool,
    ) -> dict[str, Any]:
        total = 0.0
        sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        outputs: dict[int, list[float]] = {}
        failure: list[str] | None = None
        rounds = self.comm.max_int(len(batches))
        try:
            for i in range(rounds):
                fault_point("micro_batch")
                real = i < len(batches)
                batch = batches[i] if real else _dummy_batch()
                with torch.set_grad_enabled(not forward_only):
                    logprobs_P, entropy_P, link = self._logprobs_linked(batch, forward_only)
                    loss = link
                    if real:
                        out, failure = self._loss(fn, batch, logprobs_P, norm, failure)
                        if out is not None:
                            loss = out.loss + link
                            total += float(out.loss.detach())
                            add_metrics(sums, out.metrics)
                if not forward_only:
                    loss.backward()
                if real:
                    add_metrics(sums, {}, entropy_P)
                if real and return_outputs:
                    self._collect_outputs(batch, logprobs_P.detach().float().cpu(), outputs)
        finally:
            if forward_only:
                reshard(self.resource.root)
        reports = self.comm.all_gather_json(
            {"loss": total, "sums": sums, "outputs": outputs, "failure": failure}
        )
        for report in reports:  # the same reports on every rank: all raise, or none
            if report["failure"] is not None:
                raise OperationError(*report["failure"])
        if not forward_only:
            self._sum_replicated_grads()
        loss_total, merged, merged_outputs = _merge_reports(reports)
        return call_result(loss_total, merged, merged_outputs if return_outputs else None, norm)

    def _loss(
        self,
        fn: Callable[[LossInputs, MicroBatch], LossOutputs],
        batch: MicroBatch,
        logprobs_P: torch.Tensor,
        norm: LossNorm,
        failure: list[str] | None,
    ) -> tuple[LossOutputs | None, list[str] | None]:
        """The micro-batch's loss, or None and the first failure: no rank raises mid-call,
        so every rank runs the same collectives and all fail together afterwards."""
        try:
            out = fn(self._loss_inputs(batch, logprobs_P, norm), batch)
        except ValueError as exc:
            return None, failure or ["INVALID_INPUT", str(exc)]
        if not torch.isfinite(out.loss):
            return None, failure or ["NON_FINITE_LOSS", f"the loss is not finite ({out.loss})"]
        return out, failure

    def _logprobs_linked(
        self, batch: MicroBatch, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        device = self.device
        model = self.policy.model
        mask = batch.attention_mask(model.config._attn_implementation, device, model.dtype)
        return cast(
            tuple[torch.Tensor, torch.Tensor | None, torch.Tensor],
            self.resource.root(
                _sharded_logprobs,
                batch.tokens_R_L.to(device),
                batch.position_ids_R_L.to(device),
                mask,
                batch.keep_index_P.to(device),
                batch.targets_P.to(device),
                self.options.chunk_tokens,
                with_entropy,
            ),
        )

    def _sum_replicated_grads(self) -> None:
        """LoRA adapters are replicated: sum their new gradients over ranks, in one buffer."""
        params = [p for p in self.policy.trainable.values() if not isinstance(p, DTensor)]
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = self.comm.sum_(torch.cat([g.reshape(-1) for g in grads]))
        offset = 0
        for param in params:
            n = param.numel()
            param.grad = flat[offset : offset + n].view_as(param).clone()
            offset += n

    def _check_new_grads(self) -> None:
        grads = [p.grad for p in self.policy.trainable.values() if p.grad is not None]
        norm = self._grad_norm(grads)
        if not torch.isfinite(torch.tensor(norm)):
            raise OperationError("NON_FINITE_LOSS", "the gradient is not finite")

    def _grad_norm(self, grads: list[torch.Tensor]) -> float:
        """sqrt(Σ over ranks of the sharded parts² + the replicated parts²), in fp64."""
        sharded = torch.zeros(1, dtype=torch.float64, device=self.device)
        replicated = torch.zeros(1, dtype=torch.float64, device=self.device)
        for grad in grads:
            square = local_part(grad).to(self.device, torch.float64).pow(2).sum()
            if isinstance(grad, DTensor):
                sharded += square
            else:
                replicated += square
        self.comm.sum_(sharded)
        return float((sharded + replicated).sqrt())

    def _clip_grads(self, params: list[nn.Parameter], max_norm: float, norm: float) -> None:
        """As `clip_grads_with_norm_`, on each rank's local part of the gradients."""
        coef = torch.clamp(max_norm / (torch.tensor(norm) + 1e-6), max=1.0)
        with torch.no_grad():
            for param in params:
                if param.grad is not None:
                    grad = local_part(param.grad)
                    grad.mul_(coef.to(grad.device))

    # -- generator -------------------------------------------------------------------------

    def _model_forward(self, model: nn.Module) -> Callable[..., Any]:
        root = self.resource.root

        def forward(**kwargs: Any) -> Any:
            return root(_call_model, **kwargs)

        return forward

    def _agree_tokens(self, chosen_S: torch.Tensor) -> torch.Tensor:
        return self.comm.broadcast_(chosen_S.contiguous())

    def sample(
        self,
        model_inputs: list[ModelInput],
        *,
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
    ) -> dict[str, Any]:
        try:
            return super().sample(
                model_inputs,
                num_samples=num_samples,
                sampling_params=sampling_params,
                prompt_logprobs=prompt_logprobs,
                topk_prompt_logprobs=topk_prompt_logprobs,
            )
        finally:
            reshard(self.resource.root)

    # -- checkpoints -----------------------------------------------------------------------

    def save_training_checkpoint(self) -> CheckpointRecord:
        """LoRA: rank 0 writes the single-process files. Full weights: every rank writes its
        shards of weights and AdamW state with DCP under `sharded/`; rank 0 adds RNG + state."""
        comm = self.comm
        sharded = self._sharded
        with self._running():
            rng = {"cpu": self._cpu_rng.clone()}
            rng.update({f"cuda{i}": s.clone() for i, s in enumerate(self._cuda_rng)})
            state = self._state_json()
            state["world_size"] = comm.world_size
            if sharded:
                tensors = self._sharded_state()
            else:
                weights = {
                    n: p.detach().to("cpu").clone() for n, p in self.policy.trainable.items()
                }
                optimizer = self._optimizer_tensors()

        def writer(out: Path) -> None:
            out = Path(comm.broadcast_json(str(out)))  # ranks ≠ 0: the directory rank 0 made
            if sharded:
                _dcp_save(tensors, out / SHARDED_DIR, comm)
            if comm.rank == 0:
                if not sharded:
                    save_file(weights, str(out / "weights.safetensors"))
                    save_file(optimizer, str(out / "optimizer.safetensors"))
                save_file(rng, str(out / "rng.safetensors"))
                write_json(out / "state.json", state)
            comm.barrier()

        record = self._store(TRAINING, writer, world_size=comm.world_size)
        self.training_checkpoints.append(record)
        return record

    def _sharded_state(self) -> dict[str, torch.Tensor]:
        """Live weights and AdamW state under the single-process keys (DTensors: no copy)."""
        tensors: dict[str, torch.Tensor] = {}
        for name, param in self.policy.trainable.items():
            tensors[name] = param.detach()
            for slot, value in self.optimizer.state.get(param, {}).items():
                tensors[f"{name}::{slot}"] = value
        return tensors

    def save_inference_checkpoint(self) -> CheckpointRecord:
        with self._running():
            state = gather_full_state(self.policy.model)
        if self.comm.rank != 0:
            return placeholder_record()
        return self._write_inference(GatheredModel(self.policy.model, state))


def _call_model(model: Any, **kwargs: Any) -> Any:
    return model(**kwargs)


def _dcp_save(tensors: dict[str, torch.Tensor], directory: Path, comm: Comm) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    directory.mkdir(parents=True, exist_ok=True)
    writer = HuggingFaceStorageWriter(str(directory), save_distributed=True)
    dcp.save(dict(tensors), storage_writer=writer, process_group=comm.control)


def placeholder_record() -> CheckpointRecord:
    """Ranks ≠ 0 keep no catalogue: their result of a checkpoint call is never read."""
    return CheckpointRecord("", TRAINING, "", 0, "", None, 0.0, Path())

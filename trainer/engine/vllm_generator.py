"""The vLLM generator: a session's samples from the resource's vLLM replicas
(`trainer/engine/replicas.py`), with the session's published weights synced in.

The policy's published copy in this process stays the source of truth (`InProcessGenerator`
keeps it): publishing and serving a snapshot update it exactly as in-process, then push it to
every replica — a LoRA session's adapter as a PEFT directory loaded under a new adapter id
(its name carries the session and the weights version), a full-weight session's weights in
place (the whole model, so packed q/k/v and gate/up groups always move together). Undoing a
serve swaps the copy back and pushes it again. What the copy serves besides: prompt
logprobs and the other prompt-side asks (target ids, draws: teacher-forced on the published
weights, as in-process), and samples that record
MoE routes (`return_routed_experts`), which run on the in-process loop (this vLLM version
returns no routed experts), constrained samples (`grammar`, docs/semantics.md §17.2), which run
there too so that every backend masks the same way, and every sample of a LoRA session whose
adapter vLLM refuses for this family (an output-head or embedding adapter, say:
`train_unembed`), logged and listed in
`status_details.generator.in_process_sessions` (`replica_check.py`).

A sample holds the resource's lock only to apply a pending publish, draw its seed and compute
prompt logprobs; the generation itself runs on a replica without it, so training and other
sessions' samples go on meanwhile, and vLLM batches concurrent samples of any sessions
(continuous batching: each returns when its own rows are done). Per generated token, the top
k are vLLM's `logprobs=k` (raw logprobs); sampling logprobs only where exact
(`_check_servable`); a watch is asked before the request, then told each engine step's new
tokens and asked again (`replica_watch.py`): once it says stop, the replica cancels the rows,
which keep what they made. A failed generation puts the session back as it was (RNG stream,
versions, the pending publish). Design notes: `docs/design/vllm.md`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import shutil
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from trainer.compute import sampler
from trainer.contract.errors import OperationError, invalid
from trainer.engine.generator import (
    PromptSamples,
    SampleCall,
    SamplingSession,
    answer,
    apply_pending,
    sample_alone,
)
from trainer.engine.in_process import InProcessGenerator
from trainer.engine.replica_check import unsupported, write_full_weights

if TYPE_CHECKING:
    from collections.abc import Callable

    from trainer.compute.policy import Policy
    from trainer.engine.generator import Weights
    from trainer.engine.handle import ResourceHandle
    from trainer.engine.replicas import ReplicaPool

log = logging.getLogger(__name__)
_ADAPTER_IDS = itertools.count(1)  # vLLM's adapter ids: unique in this worker
_IDS_LOCK = threading.Lock()
_ROW_SEED_STEP = 0x9E3779B97F4A7C15


def row_seed(seed: int, row: int) -> int:
    """Row `row`'s own seed of a call seeded `seed`: the same call gives the same tokens."""
    return (seed + row * _ROW_SEED_STEP) % (1 << 63)


class VllmGenerator(InProcessGenerator):
    """The module docstring."""

    def __init__(
        self, resource: ResourceHandle, policy: Policy, pool: ReplicaPool, name: str
    ) -> None:
        super().__init__(resource, policy)
        self.pool = pool
        self.name = name
        self.pushes = 0
        self.served: dict[str, Any] | None = None  # the adapter the replicas serve (LoRA)
        self.served_dir: Path | None = None
        self.finite = True
        self.in_process: str | None = None  # why this session samples in-process, if it does
        self._push()

    # -- weights ---------------------------------------------------------------------------

    def publish(self) -> None:
        super().publish()
        self._push()

    def serve(self, snapshot: Weights) -> Callable[[], None]:
        swap_back = super().serve(snapshot)

        def undo() -> None:
            swap_back()
            self._push()

        self._push()
        return undo

    def _push(self) -> None:
        """The published copy to every replica (the module docstring). Non-finite weights are
        not pushed: their samples fail with NON_FINITE_LOSS before reaching a replica."""
        tensors = self.policy.published_tensors()
        if not tensors or self.in_process:
            return
        self.finite = all(bool(torch.isfinite(t).all()) for t in tensors.values())
        if not self.finite:
            return
        self.pushes += 1
        old, old_dir = self.served, self.served_dir
        directory = self.pool.workdir / f"{self.name}-{self.pushes}"
        directory.mkdir(parents=True)
        if self.policy.kind == "lora":
            self._write_adapter(tensors, directory)
            with _IDS_LOCK:
                adapter_id = next(_ADAPTER_IDS)
            adapter = {
                "name": f"{self.name}@{self.pushes}",
                "id": adapter_id,
                "path": str(directory),
            }
            try:
                self.pool.load_adapter(adapter)
            except RuntimeError as exc:  # this family's adapter: served in-process
                if not unsupported(str(exc)):
                    raise
                self._sample_in_process(str(exc), adapter_id, directory)
                return
            self.served, self.served_dir = adapter, directory
            if old is not None:
                self.pool.drop_adapter(int(old["id"]))
        else:
            weights = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
            write_full_weights(getattr(self.policy, "generator", None), weights, directory)
            self.pool.load_weights(directory)
            self.served_dir = directory
        if old_dir is not None:
            shutil.rmtree(old_dir, ignore_errors=True)

    def _sample_in_process(self, why: str, adapter_id: int, directory: Path) -> None:
        """vLLM refused this session's adapter: its samples run on the in-process loop."""
        with contextlib.suppress(Exception):
            self.pool.drop_adapter(adapter_id)
        shutil.rmtree(directory, ignore_errors=True)
        self.in_process = f"vLLM refused its adapter: {why}"
        self.pool.in_process[self.name] = self.in_process
        log.warning("session %s samples on the in-process loop: %s", self.name, self.in_process)

    def _write_adapter(self, tensors: Weights, directory: Path) -> None:
        from trainer.compute.policy import LoraPolicy

        assert isinstance(self.policy, LoraPolicy)
        config = self.policy.peft_config_dict()
        config["base_model_name_or_path"] = str(self.pool.model_path)
        weights = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
        save_file(weights, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
        (directory / "adapter_config.json").write_text(json.dumps(config))

    def close(self) -> None:
        """Drop the session's adapter from the replicas, and its files."""
        self.pool.in_process.pop(self.name, None)
        if self.served is not None:
            with contextlib.suppress(Exception):  # replicas already gone: nothing to drop
                self.pool.drop_adapter(int(self.served["id"]))
            self.served = None
        if self.served_dir is not None:
            shutil.rmtree(self.served_dir, ignore_errors=True)
            self.served_dir = None

    # -- samples ---------------------------------------------------------------------------

    def sample(self, session: SamplingSession, call: SampleCall) -> dict[str, Any]:
        if call.records_routes or call.grammar is not None or self.in_process:  # (docstring)
            return sample_alone(session, call)
        _check_servable(call)
        rng_before = session.cpu_rng.clone()
        versions_before = replace(session.versions)
        with session.operation_scope() as undo:
            apply_pending(session, undo)
            seed = sampler.draw_seed(call.params.seed)
            version = session.versions.applied_weights_version
            adapter, finite = self.served, self.finite
            samples = self._prompt_samples(call, seed)
        try:
            if not finite:
                raise OperationError(
                    "NON_FINITE_LOSS",
                    f"session {session.id}: its published weights are not finite, so its "
                    "samples would be garbage",
                )
            groups = self._generate(call, seed, adapter)
            for got, group in zip(samples, groups, strict=True):
                got.sequences = group
            return answer(session, call, samples, version)
        except BaseException:
            with session.resource.lock:
                for action in reversed(undo):
                    action()
                session.versions = versions_before
                session.cpu_rng = rng_before
            raise

    def _prompt_samples(self, call: SampleCall, seed: int) -> list[PromptSamples]:
        groups: list[list[sampler.Sequence]] = [[] for _ in call.prompts]
        if not call.prompt_side:
            return [PromptSamples(group) for group in groups]
        with torch.no_grad(), self._resharding(), self.policy.published() as model:
            return self.prompt_samples(call, groups, model, seed)

    def _generate(
        self, call: SampleCall, seed: int, adapter: dict[str, Any] | None
    ) -> list[list[sampler.Sequence]]:
        n = call.num_samples
        watch = call.watch
        if watch is not None and watch.stopped():  # before the request starts
            cancelled = sampler.STOP_CANCELLED
            return [
                [sampler.Sequence(stop_reason=cancelled) for _ in range(n)] for _ in call.prompts
            ]
        rows = [
            {"prompt": prompt, "seed": row_seed(seed, i * n + j), "adapter": adapter}
            for i, prompt in enumerate(call.prompts)
            for j in range(n)
        ]
        params = {
            "temperature": call.params.temperature,
            "top_p": call.params.top_p,
            "top_k": call.params.top_k,
            "max_tokens": call.params.max_tokens,
            "stop": call.params.stop,  # `sample_call` refused them without a tokenizer
            "stop_token_ids": sorted(call.eos_ids),
            "top_logprobs": call.params.top_logprobs,
        }
        progress = None if watch is None else _Progress(watch, len(rows))
        got = self.pool.generate(rows, params, progress)
        groups: list[list[sampler.Sequence]] = []
        for i in range(len(call.prompts)):
            group = []
            for row in got[i * n : (i + 1) * n]:
                if not all(math.isfinite(lp) for lp in row["logprobs"]):
                    raise OperationError(
                        "NON_FINITE_LOSS",
                        "the session's published weights give non-finite logits",
                    )
                group.append(_sequence(row, call, _STOPS.get(row["finish"])))
            groups.append(group)
        if watch is not None:
            watch.step([seq for group in groups for seq in group])  # the whole rows, at the end
        return groups


_STOPS = {"stop": sampler.STOP_STOP, "cancelled": sampler.STOP_CANCELLED}


class _Progress:
    """A sample's watch as the replica pool tells it (`replica_watch.RowWatch`): each step's
    new tokens go into live sequences, which the watch is told."""

    def __init__(self, watch: sampler.SampleWatch, rows: int) -> None:
        self.watch = watch
        self.live = [sampler.Sequence() for _ in range(rows)]

    def progress(self, rows: list[Any]) -> None:
        for row, tokens, logprobs in rows:
            self.live[row].tokens.extend(tokens)
            self.live[row].logprobs.extend(logprobs)
        self.watch.step(self.live)

    def stopped(self) -> bool:
        return self.watch.stopped()


def _check_servable(call: SampleCall) -> None:
    """`sampling_logprobs` where vLLM's answer is exact: greedy (0.0) or an untouched
    distribution (temperature 1, top_p 1, no top_k: the model's own logprob); else refused.
    `top_logprobs` is vLLM's `logprobs=k` (raw model logprobs, its default mode)."""
    p = call.params
    untouched = p.temperature == 1.0 and p.top_p >= 1.0 and p.top_k <= 0
    if call.sampling_logprobs and not (p.temperature == 0.0 or untouched):
        raise invalid(
            "sampling_logprobs",
            "the vLLM generator returns the drawn-from distribution's logprobs only greedy "
            "(temperature 0) or at temperature 1 with top_p 1 and no top_k",
        )


def _sequence(row: dict[str, Any], call: SampleCall, stop: str | None) -> sampler.Sequence:
    """A replica's row as a sequence (`_check_servable`: its sampling logprobs are exact)."""
    logprobs = [float(lp) for lp in row["logprobs"]]
    seq = sampler.Sequence(
        tokens=list(row["tokens"]), logprobs=logprobs, stop_reason=stop or sampler.STOP_LENGTH
    )
    if call.sampling_logprobs:
        greedy = call.params.temperature == 0.0
        seq.sampling_logprobs = [0.0] * len(logprobs) if greedy else list(logprobs)
    k = call.params.top_logprobs
    if k > 0:
        seq.top_logprobs = [
            {"token_ids": ids[:k], "logprobs": lps[:k]} for ids, lps in row.get("top") or []
        ]
        if len(seq.top_logprobs) != len(seq.tokens):
            raise OperationError(
                "INTERNAL_ERROR", "the replica returned no top logprobs for some tokens"
            )
    return seq

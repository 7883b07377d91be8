"""Sessions sharded with FSDP2 across the ranks of a `torchrun` job, driven from rank 0.

    torchrun --nproc_per_node N -m trainer serve <the usual flags>

Modules: `comm` (JSON over uint8 tensors, collectives with timeouts, joining the job: the
`Communicator` a session is given), `sharding` (FSDP2 wrapping, gathering for exports, the
`Sharded` placement), `spmd` (the command stream: rank 0's proxies, the executor every rank
runs, the workers' loop), `follower_store` (the checkpoint store of ranks ≠ 0). There is no
distributed session or resource: every rank runs the one `TrainingSession` / `ModelResource`
(`trainer/engine/session.py`), given a `Sharded` placement and its communicator.

Execution model (SPMD). Rank 0 serves HTTP; its `DistributedResource` / `DistributedSession`
have the interface of `ModelResource` / `TrainingSession`; the session methods they forward
are those of the operation table (`trainer.serving.operations`). Each call is turned into a JSON
command (each argument through a pydantic `TypeAdapter` of the engine method's own
annotation), broadcast to every rank as bytes in a
uint8 tensor (length first, then the bytes: no pickle), and executed by every rank on its
own replica of the engine objects (`Executor`). Ranks ≠ 0 sit in `run_worker`. After each
command all ranks exchange their outcome (on a process group of its own): all succeeded →
rank 0's result; all raised an `OperationError` (bad input, non-finite loss: raised where the
ranks are in step, state untouched) → that error. Anything else, i.e. some ranks only, an
unexpected exception, or a collective that fails or times out (`[distributed]
collective_timeout_s`: a dead or stuck rank) → the group is *broken*: the operation fails with
an `INTERNAL_ERROR` that names each failing rank with its exception type and message, every
later call fails at once, and the workers exit. Commands are serialised by one lock: one
operation at a time across the whole worker, whatever the resource or session, except that
concurrent forward(-backward) calls of a LoRA resource's sessions are grouped by rank 0's
combiner into one `pass_group` command (`batching`): shared passes on every rank, one outcome
per call (a call's failure is its own).

Sharding. The model is loaded on the CPU by every rank (in the compute dtype, with the
attention of the compute device: the same packed varlen path as one process), then
`fully_shard` is applied per decoder layer and once more to `ShardedRoot`, a wrapper whose
forward runs a function of the model: every compute (training logprobs, generation steps)
enters through the root's hooks.
CUDA: bf16 compute with fp32 gradient reduction (`MixedPrecisionPolicy`), NCCL. CPU: fp32 and
gloo. Gradient reductions are plain sums (divide factor 1, sum-only collectives): each rank's
loss is a partial sum with call-level denominators. Optional CPU offload of parameters,
gradients and AdamW state (`[distributed] cpu_offload`). Loading needs the full model in each
rank's CPU memory for a moment (it is read once per rank, then only the rank's shards are kept).
LoRA: the frozen base is sharded; adapters are added later by peft (one per session) and stay
*replicated*: plain tensors on every rank whose gradients are summed by one all-reduce per
call. Memory: each rank holds every adapter of the resource and its AdamW state (about 3x the
adapter, e.g. 0.3 GB for a rank-32 adapter on Qwen3-0.6B), against 1/N of the base.

Data parallelism. Every rank receives the whole call, validates it, computes the call-level
`LossNorm`, takes its share of samples (longest first, to the rank with the fewest tokens),
and packs its share into micro-batches. All ranks run the same number of micro-batches: a rank
with fewer runs dummy ones (one masked token, loss 0·logprob) that still go through every FSDP
unit, so collectives match. Loss and metrics are summed across ranks; the gradients equal the
single-process ones. Finite checks (loss, gradient norm) are global. LoRA dropout draws
different masks than a single process would (same RNG state, different data per rank).

Sampling. All ranks run the generation SPMD on the sharded model; rank 0 chooses each token and
broadcasts it. Cost: every decoding step all-gathers every FSDP unit (the full weights cross
the network once per generated token, as ZeRO-3 inference does) plus one broadcast of the
chosen ids; memory stays sharded. A full-weight session keeps its published weights as a
sharded copy and swaps them in for sampling.

Checkpoints. Training: a LoRA adapter (replicated) is written by rank 0 in the single-process
layout. Full weights are written with `torch.distributed.checkpoint` and
`HuggingFaceStorageWriter(save_distributed=True)` under `sharded/`: each rank writes its own
safetensors shards, slice offsets in the header; tensor keys are those of the single-process
files (`name`, `name::slot`). Resume under any world size: DCP-load into the shards, or
`training_state.read_sharded` in one process. Inference: consolidated safetensors gathered to rank 0
on the CPU, or the PEFT adapter; the files do not depend on the world size.
Multi-node: `--storage` must be a filesystem shared by all ranks.
"""

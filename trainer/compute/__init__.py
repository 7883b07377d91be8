"""Torch on one loaded model: loading and exports (`model`), attention for packed rows,
batches and packing (`batch`), logprobs, losses, what a session trains (`policy`), where it
lives (`placement`, `rounds`), the optimizers (`optim`, `muon`), the decode loop (`sampler`),
segment-wise LoRA (`multilora`), MoE routing replay (`moe_replay`) and the fair compute lock
(`turns`).

It imports only `trainer.contract`: it knows no session, queue, checkpoint store or HTTP.
"""

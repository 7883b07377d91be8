"""MoE routing replay (docs/semantics.md §12) against an independent plain-torch Qwen3-MoE forward
that
takes forced expert ids and the session's weights."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.engine.helpers import make_resource, model_input, sample
from trainer.contract.errors import OperationError
from trainer.contract.options import EngineOptions
from trainer.contract.specs import AdamParams, LoraConfig, LossConfig, SamplingParams, SessionSpec
from trainer.engine import moe_replay_keys
from trainer.engine.batching.sample_batch import sample_counters
from trainer.engine.moe_replay_keys import ReplayKeys
from trainer.tiny import TinySpec, save_model

CE = LossConfig(type="cross_entropy")
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]


@pytest.fixture(scope="module")
def moe_dir(tiny_moe_dir: Path) -> Path:
    """The shared tiny Qwen3-MoE (`tests/conftest.py`: 2 layers, 4 experts, top-2)."""
    return tiny_moe_dir


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(TinySpec(arch="qwen3", scale=8.0), tmp_path_factory.mktemp("tiny-dense"))


# -- the independent reference ----------------------------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x [heads, T, D], positions 0..T-1 (the rotate-half form)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.arange(x.shape[1], dtype=torch.float32)[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], -1)
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * emb.cos() + half * emb.sin()


def reference(
    w: dict[str, torch.Tensor], config, tokens: list[int], forced: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [T, V] of one sequence and the router's own top-k ids [T, layers, k]. Positions
    `< len(forced)` go to `forced[t, layer]` with weights softmax(router)[ids], renormalised."""
    eps, theta = config.rms_norm_eps, config.rope_parameters["rope_theta"]
    heads, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    k = config.num_experts_per_tok
    n = len(tokens)
    h = w["model.embed_tokens.weight"][torch.tensor(tokens)]
    own_ids = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        x = _rms(h, w[p + "input_layernorm.weight"], eps)
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, d)
        kk = (x @ w[p + "self_attn.k_proj.weight"].T).view(n, kv, d)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, kv, d).transpose(0, 1)
        q = _rope(_rms(q, w[p + "self_attn.q_norm.weight"], eps).transpose(0, 1), theta)
        kk = _rope(_rms(kk, w[p + "self_attn.k_norm.weight"], eps).transpose(0, 1), theta)
        rep = heads // kv
        kk, v = kk.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        scores = q @ kk.transpose(-1, -2) / d**0.5
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        att = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v
        h = h + att.transpose(0, 1).reshape(n, heads * d) @ w[p + "self_attn.o_proj.weight"].T
        x = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        probs = torch.softmax(x @ w[p + "mlp.gate.weight"].T, -1)
        own = probs.topk(k, -1).indices
        own_ids.append(own)
        ids = own.clone()
        if forced is not None:
            ids[: forced.shape[0]] = forced[:, i].long()
        cw = probs.gather(-1, ids)
        if config.norm_topk_prob:
            cw = cw / cw.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        gate_up, down = w[p + "mlp.experts.gate_up_proj"], w[p + "mlp.experts.down_proj"]
        for t in range(n):
            for j in range(k):
                e = int(ids[t, j])
                g, u = (gate_up[e] @ x[t]).chunk(2)
                out[t] = out[t] + cw[t, j] * (down[e] @ (torch.nn.functional.silu(g) * u))
        h = h + out
    h = _rms(h, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return torch.log_softmax(h @ head.T, -1), torch.stack(own_ids, 1)


def weights(session) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone().float() for n, t in session.policy.model.state_dict().items()}


# -- helpers ----------------------------------------------------------------------------------


def _sampled(session, n: int = 2, max_tokens: int = 8, seed: int = 1) -> list[dict]:
    """[{prompt, tokens, logprobs, key}] for each sequence."""
    params = SamplingParams(max_tokens=max_tokens, seed=seed, temperature=1.0)
    out = session.sample(
        [model_input(p) for p in PROMPTS],
        num_samples=n,
        sampling_params=params,
        return_routed_experts=True,
    )
    seqs = []
    for prompt, result in zip(PROMPTS, out["results"], strict=True):
        for seq in result["sequences"]:
            seqs.append({"prompt": prompt, **seq, "key": seq.get("routed_experts_key")})
    return seqs


def _probe(seq: dict, key: str | None, full: bool = False):
    """The training sample of a sampled sequence: prompt + completion[:-1] (or all of it)."""
    tokens = seq["prompt"] + seq["tokens"]
    inputs, targets = (tokens, [*tokens[1:], 0]) if full else (tokens[:-1], tokens[1:])
    s = sample(inputs, targets, weights=[1.0] * len(inputs))
    s.routed_experts_key = key
    return s


def _forward(session, samples) -> list[torch.Tensor]:
    out = session.forward_backward(CE, samples, forward_only=True, return_loss_fn_outputs=True)
    return [torch.tensor(o["tensors"]["logprobs"]["data"]) for o in out["loss_fn_outputs"]]


def _ref_lp(w, config, s, forced) -> torch.Tensor:
    lp, _ = reference(w, config, s.model_input.tokens, forced)
    targets = torch.tensor(s.loss_fn_inputs["target_tokens"].data)
    return lp.gather(-1, targets[:, None]).squeeze(-1)


def _routes(session, key: str) -> torch.Tensor:
    return moe_replay_keys.store_for(session).get(key)[2]


# -- tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("lora", [False, True])
def test_replay_at_sampling_weights_equals_sampler_and_reference(moe_dir, tmp_path, lora) -> None:
    resource = make_resource(moe_dir, tmp_path, lora=lora)
    spec = SessionSpec(lora_config=LoraConfig(rank=4, seed=1)) if lora else SessionSpec()
    session = resource.create_session("a", spec)
    seqs = _sampled(session)
    assert all(s["key"] and s["key"].startswith("re-") for s in seqs)
    assert len({s["key"] for s in seqs}) == len(seqs)
    config = session.policy.model.config
    w = weights(session) if not lora else None
    probes = [_probe(s, s["key"]) for s in seqs]
    # all sequences in one call: packed together, each key follows its own sample
    replayed = _forward(session, probes)
    for seq, probe, lp in zip(seqs, probes, replayed, strict=True):
        routes = _routes(session, seq["key"])
        n_prompt = len(seq["prompt"])
        assert routes.shape == (len(probe.model_input.tokens), 2, 2)  # prompt + completion[:-1]
        sampled = torch.tensor(seq["logprobs"])
        torch.testing.assert_close(lp[n_prompt - 1 :], sampled, atol=1e-5, rtol=0)
        if w is not None:  # full weights: the state dict is the whole model
            ref = _ref_lp(w, config, probe, routes)
            torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)


def test_replay_after_route_changing_steps_follows_recorded_experts(moe_dir, tmp_path) -> None:
    resource = make_resource(moe_dir, tmp_path, lora=False)
    session = resource.create_session("a", SessionSpec())
    seqs = _sampled(session)
    probes = [_probe(s, s["key"]) for s in seqs]
    plain = [_probe(s, None) for s in seqs]
    for _ in range(3):  # a large step on everything, routers included
        session.forward_backward(CE, plain)
        session.optim_step(AdamParams(learning_rate=0.05, grad_clip_norm=0.0))
    config = session.policy.model.config
    w = weights(session)
    replayed, free = _forward(session, probes), _forward(session, plain)
    changed = 0
    for seq, probe, lp, lp_free in zip(seqs, probes, replayed, free, strict=True):
        routes = _routes(session, seq["key"])
        _, own = reference(w, config, probe.model_input.tokens, None)
        flips = own.sort(-1).values != routes.long().sort(-1).values
        changed += int(flips.any(-1).any(-1).sum())
        torch.testing.assert_close(lp, _ref_lp(w, config, probe, routes), atol=1e-5, rtol=0)
        torch.testing.assert_close(lp_free, _ref_lp(w, config, probe, None), atol=1e-5, rtol=0)
        if bool(flips.any()):
            assert (lp - lp_free).abs().max() > 1e-4
    assert changed > 0  # the steps did change routes: replay is what kept the recorded ones


@pytest.mark.parametrize("checkpointing", [False, True])
def test_router_gradient_through_combine_weights(moe_dir, tmp_path, checkpointing) -> None:
    options = EngineOptions(activation_checkpointing=checkpointing)
    resource = make_resource(moe_dir, tmp_path, lora=False, options=options)
    session = resource.create_session("a", SessionSpec())
    seqs = _sampled(session, n=1)
    session.forward_backward(CE, [_probe(s, None) for s in seqs])
    session.optim_step(AdamParams(learning_rate=0.05, grad_clip_norm=0.0))  # routes move
    probes = [_probe(s, s["key"]) for s in seqs]
    config = session.policy.model.config
    w = {n: t.requires_grad_(True) for n, t in weights(session).items()}
    loss = sum(
        -_ref_lp(w, config, p, _routes(session, s["key"])).sum() for s, p in zip(seqs, probes)
    )
    loss.backward()
    own = [reference(w, config, p.model_input.tokens, None)[1] for p in probes]
    recorded = [_routes(session, s["key"]).long() for s in seqs]
    assert any(  # the step moved some routes: the replayed ones are not the router's own
        bool((o.sort(-1).values != r.sort(-1).values).any()) for o, r in zip(own, recorded)
    )
    session.forward_backward(CE, probes)
    params = dict(session.policy.model.named_parameters())
    for i in range(config.num_hidden_layers):
        name = f"model.layers.{i}.mlp.gate.weight"
        got = params[name].grad
        assert got is not None and got.abs().max() > 0
        torch.testing.assert_close(got, w[name].grad, atol=1e-5, rtol=1e-4)


def test_keys_refused_with_the_field(moe_dir, tmp_path) -> None:
    resource = make_resource(moe_dir, tmp_path, lora=True)
    a = resource.create_session("a", SessionSpec(lora_config=LoraConfig(rank=4, seed=1)))
    b = resource.create_session("b", SessionSpec(lora_config=LoraConfig(rank=4, seed=2)))
    seq = _sampled(a, n=1)[0]
    field = "samples[0].routed_experts_key"

    def refused(session, s, why: str) -> str:
        with pytest.raises(OperationError) as err:
            session.forward_backward(CE, [s])
        assert err.value.code == "INVALID_INPUT" and field in str(err.value), why
        return str(err.value)

    # another session's key reads exactly as one never issued (nothing tells it exists)
    foreign = refused(b, _probe(seq, seq["key"]), "another session's key")
    unknown = refused(a, _probe(seq, "re-" + "0" * 32), "unknown")
    assert foreign == unknown
    refused(a, _probe(seq, "../../etc/passwd"), "malformed")
    bad = _probe(seq, seq["key"])
    bad.model_input.chunks[0].encoded_text.tokens[2] += 1
    refused(a, bad, "a token differs from the recording")
    longer = _probe(seq, seq["key"], full=True)
    longer.model_input.chunks[0].encoded_text.tokens.append(3)
    longer.loss_fn_inputs["target_tokens"].data.append(3)
    longer.loss_fn_inputs["weights"].data.append(1.0)
    refused(a, longer, "two tokens past the routed positions")
    # accepted: the whole sequence (its final token unrouted), and a different final token
    a.forward_backward(CE, [_probe(seq, seq["key"], full=True)], forward_only=True)
    last = _probe(seq, seq["key"])
    last.model_input.chunks[0].encoded_text.tokens[-1] = 3
    a.forward_backward(CE, [last], forward_only=True)
    # expiry
    store = moe_replay_keys.store_for(a)
    store.clock = lambda: time.time() + a.options.routes_ttl_s + 1
    try:
        refused(a, _probe(seq, seq["key"]), "expired")
    finally:
        store.clock = time.time


def test_keys_survive_a_restart_and_keep_a_byte_budget(tmp_path) -> None:
    routes = torch.randint(0, 4, (5, 2, 2))
    first = ReplayKeys(tmp_path)
    key = first.put("s1", [1, 2, 3, 4, 5, 6], routes)
    again = ReplayKeys(tmp_path)  # a restart: the index comes from the files
    owner, tokens, got = again.get(key)
    assert (
        owner == "s1"
        and tokens.tolist() == [1, 2, 3, 4, 5, 6]
        and torch.equal(got, routes.to(torch.int16))
    )
    size = (tmp_path / "routes" / f"{key}.safetensors").stat().st_size
    clock = [1000.0]
    small = ReplayKeys(tmp_path / "b", ttl_s=50.0, max_bytes=2 * size, clock=lambda: clock[0])
    keys = []
    for _ in range(3):
        keys.append(small.put("s", [1, 2, 3, 4, 5, 6], routes))
        clock[0] += 1
    with pytest.raises(moe_replay_keys.UnknownKey):
        small.get(keys[0])  # the oldest, dropped for the budget
    assert small.get(keys[1])[0] == small.get(keys[2])[0] == "s"
    assert not (tmp_path / "b" / "routes" / f"{keys[0]}.safetensors").exists()
    clock[0] += 60
    with pytest.raises(moe_replay_keys.UnknownKey, match="expired"):
        small.get(keys[2])
    assert not (tmp_path / "b" / "routes" / f"{keys[2]}.safetensors").exists()


def test_key_works_after_a_restart_of_the_worker(moe_dir, tmp_path) -> None:
    resource = make_resource(moe_dir, tmp_path, lora=False)
    session = resource.create_session("a", SessionSpec())
    seq = _sampled(session, n=1)[0]
    before = _forward(session, [_probe(seq, seq["key"])])[0]
    moe_replay_keys._STORES.clear()  # a new process: a new store on the same storage
    after = _forward(session, [_probe(seq, seq["key"])])[0]
    assert torch.equal(before, after)


def test_dense_model_ignores_the_flag(dense_dir, tmp_path) -> None:
    resource = make_resource(dense_dir, tmp_path, lora=True)
    session = resource.create_session("a", SessionSpec(lora_config=LoraConfig(rank=4)))
    seqs = _sampled(session)
    assert all("routed_experts_key" not in s for s in seqs)
    with pytest.raises(OperationError, match=r"samples\[0\]\.routed_experts_key"):
        session.forward_backward(CE, [_probe(seqs[0], "re-" + "1" * 32)])
    assert not (tmp_path / "routes").exists()


def test_no_key_without_the_flag(moe_dir, tmp_path) -> None:
    resource = make_resource(moe_dir, tmp_path, lora=True)
    session = resource.create_session("a", SessionSpec(lora_config=LoraConfig(rank=4)))
    out = session.sample([model_input(PROMPTS[0])], sampling_params=SamplingParams(max_tokens=4))
    assert "routed_experts_key" not in out["results"][0]["sequences"][0]


def test_batched_samples_record_each_rows_routes(moe_dir, tmp_path, monkeypatch) -> None:
    """Two sessions' samples in one generation batch: each sequence's key replays its own
    routes (the replayed forward equals its sampled logprobs); keyed samples never merge.
    Sessions with LoRA on the experts never batch (`policy.segmentable`), so these adapt the
    attention only."""
    import trainer.compute.lora_targets

    monkeypatch.setattr(trainer.compute.lora_targets, "lora_target_parameters", lambda model: [])
    options = EngineOptions(merge_window_ms=200.0, decode_steps_per_turn=2)
    resource = make_resource(moe_dir, tmp_path, lora=True, options=options)
    sessions = [
        resource.create_session(name, SessionSpec(lora_config=LoraConfig(rank=4, seed=i + 1)))
        for i, name in enumerate("ab")
    ]
    for s in sessions:  # distinct adapters: train each a little and publish
        s.forward_backward(CE, [sample([5, 6, 7, 8], [6, 7, 8, 9], weights=[1.0] * 4)])
        s.optim_step(AdamParams(learning_rate=0.05))
        s.weights_sync("WEIGHT_SYNC_TYPE_SYNCHRONOUS")
    with ThreadPoolExecutor(len(sessions)) as pool:
        futures = [pool.submit(_sampled, s, 2, 6, 7) for s in sessions]
        results = {s.id: f.result() for s, f in zip(sessions, futures, strict=True)}

    assert sample_counters(resource)["sample_batches"] >= 1
    for s in sessions:
        seqs = results[s.id]
        probes = [_probe(q, q["key"]) for q in seqs]
        prepared = s._prepare(probes)
        assert all(p.routed_experts is not None for p in prepared)
        assert not resource.scheduler.eligible(s, prepared)  # keyed samples run alone
        for seq, lp in zip(seqs, _forward(s, probes), strict=True):
            n_prompt = len(seq["prompt"])
            torch.testing.assert_close(
                lp[n_prompt - 1 :], torch.tensor(seq["logprobs"]), atol=1e-5, rtol=0
            )


@pytest.mark.parametrize("attention", ["packed_sdpa", "eager"])
def test_keys_follow_their_samples_in_padded_and_varlen_rows(moe_dir, tmp_path, attention) -> None:
    """Rows of 16 tokens and micro-batches of 32: the samples of one call spread over several
    padded rows (eager: the `[rows, L]` layout) or one unpadded row (varlen), keyed ones
    beside unkeyed ones; each keyed sample replays its own routes."""
    options = EngineOptions(row_tokens=16, token_budget=32)
    resource = make_resource(moe_dir, tmp_path, lora=False, options=options)
    session = resource.create_session("a", SessionSpec())
    model = session.policy.model
    model.set_attn_implementation(attention)
    assert model.config._attn_implementation == attention
    seqs = _sampled(session, n=2, max_tokens=6)
    for _ in range(2):  # move the routes, so that a misplaced route changes a logprob
        session.forward_backward(CE, [_probe(s, None) for s in seqs])
        session.optim_step(AdamParams(learning_rate=0.05, grad_clip_norm=0.0))
    config, w = model.config, weights(session)
    probes = [_probe(s, s["key"] if i % 2 == 0 else None) for i, s in enumerate(seqs)]
    probes.append(sample([3, 4, 5], [4, 5, 6], weights=[1.0] * 3))  # a short unkeyed filler
    for probe, lp in zip(probes, _forward(session, probes), strict=True):
        key = probe.routed_experts_key
        forced = _routes(session, key) if key else None
        torch.testing.assert_close(lp, _ref_lp(w, config, probe, forced), atol=1e-5, rtol=0)

"""A deployment of a promoted model (docs/semantics.md §24): `baseModel` names
`accounts/<a>/models/<m>`, a LoRA adapter or a merged full model promoted in the caller's
account, as the cookbook's distillation recipe names a fine-tuned teacher. The deployment
serves that checkpoint from its start (hot-loaded; a completion meanwhile is a 425): its
logprobs are the trained session's, not the base model's. Another account's model answers as
a missing one."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.api.conftest import LiveServer
from tests.fireworks import test_control_plane_checkpoints as checkpoints_module
from tests.fireworks.conftest import LLAMA, QWEN
from tests.fireworks.test_control_plane import client, create, error, sdk_body
from tests.fireworks.test_control_plane_checkpoints import op, promote, trained_session
from tests.fireworks.test_data_plane import close, reference_logprobs
from tests.fireworks.test_deployments import BODY, settled
from tests.fireworks.test_deployments_sdk import SEQS, deployment_logprobs
from trainer.serving.tenants import Principal

pytestmark = pytest.mark.fireworks

live = checkpoints_module.live  # the two accounts' server (a module fixture)


def _forward(http: httpx.Client, sid: str) -> list[list[float]]:
    """The session's own logprobs of `SEQS` (a forward through the RL face)."""
    samples = [
        {
            "model_input": {"chunks": [{"encoded_text": {"tokens": s[:-1]}}]},
            "loss_fn_inputs": {
                "target_tokens": {"data": s[1:], "dtype": "int64"},
                "weights": {"data": [1.0] * (len(s) - 1), "dtype": "float32"},
            },
        }
        for s in SEQS
    ]
    body = {
        "loss": {"type": "LOSS_TYPE_CROSS_ENTROPY"},
        "samples": samples,
        "forward_only": True,
        "return_loss_fn_outputs": True,
    }
    out = op(http, sid, "forward-backward", body)
    return [o["tensors"]["logprobs"]["data"] for o in out["loss_fn_outputs"]]


def _deploy(c: httpx.Client, account: str, dep: str, base: str) -> httpx.Response:
    return c.post(
        f"/v1/accounts/{account}/deployments",
        params={"deploymentId": dep, "skipShapeValidation": "true"},
        json={**BODY, "baseModel": base, "minReplicaCount": 1},
    )


@pytest.mark.parametrize(("base", "lora"), [(QWEN, True), (LLAMA, False)])
def test_a_promoted_model_deploys_with_its_weights(
    live: LiveServer, fw_models: dict[str, Any], base: str, lora: bool
) -> None:
    c = client(live, "alice")
    job = f"dep-{'lora' if lora else 'full'}"
    assert create(c, "alice", job, sdk_body(base, rank=8 if lora else 0)).status_code == 200
    http, sid = trained_session(live, job, lora=lora)
    sampler = op(http, sid, "inference-checkpoint")["checkpoint"]["id"]
    assert promote(c, job, sampler, f"{job}-model").status_code == 200
    name = f"accounts/alice/models/{job}-model"
    want = _forward(http, sid)
    assert not close(want, reference_logprobs(fw_models[base], SEQS))  # it was trained

    made = _deploy(c, "alice", job, name)
    assert made.status_code == 200, made.text
    assert made.json()["baseModel"] == name
    replica = settled(c, "alice", job)
    assert replica["loading_state"]["stage"] == "done", replica
    identity, got = deployment_logprobs(
        live, f"accounts/alice/deployments/{job}", Principal("alice")
    )
    assert identity == name
    assert close(got, want), (got, want)
    # scaled to zero and back: the promoted weights again, not the base model's
    url = f"/v1/accounts/alice/deployments/{job}"
    assert c.patch(url, json={"minReplicaCount": 0, "maxReplicaCount": 0}).status_code == 200
    assert c.patch(url, json={"minReplicaCount": 1, "maxReplicaCount": 1}).status_code == 200
    settled(c, "alice", job)
    again = deployment_logprobs(live, f"accounts/alice/deployments/{job}", Principal("alice"))
    assert again[0] == name and close(again[1], want), again

    # bob: alice's model is one he cannot name, exactly as one that does not exist
    bob = client(live, "bob")
    theirs = error(_deploy(bob, "bob", job, name))
    missing = error(_deploy(bob, "bob", job, "accounts/alice/models/nothing-here"))
    assert theirs["param"] == missing["param"] == "baseModel"
    assert theirs["message"].replace(name, "<m>") == missing["message"].replace(
        "accounts/alice/models/nothing-here", "<m>"
    )
    c.delete(f"/v1/accounts/alice/deployments/{job}")
    c.delete(f"/v1/accounts/alice/rlorTrainerJobs/{job}")

"""Checkpoint names of the Tinker face: a name that some route could not address (a '.', a
space, Unicode, NUL, a leading '-' or '_', too long) is a 400 naming `path` on every save
route, and saves nothing; every name that is accepted can be listed, signed (sampler and
external checkpoints) and deleted."""

from __future__ import annotations

import httpx

from tests.api.conftest import LiveServer
from tests.tinker import tinker_http as th

SAVES = {
    "/save_weights": "weights",
    "/save_weights_for_sampler": "sampler_weights",
    "/save_weights_external": "external_weights",
}
BAD_NAMES = [
    "ckpt.v1",
    "step 1",
    "ünïcode",
    "a\x00b",
    "tab\tname",
    "-lead",
    "_lead",
    "a;b",
    "%2e%2e",
    "a/b",
    "..",
    ".",
    "",
    "x" * 201,
]
GOOD_NAMES = ["a", "0", "step_1", "v-1:2", "A9z", "x" * 200]


def test_names_no_route_can_address_are_refused(
    live: LiveServer, http: httpx.Client, model: str
) -> None:
    before = th.records(live)
    for route in SAVES:
        for name in BAD_NAMES:
            response = http.post(route, json={"model_id": model, "path": name})
            assert response.status_code == 400, (route, name, response.text)
            error = response.json()["error"]
            assert error["param"] == "path" and error["message"].startswith("path: "), error
    assert th.records(live) == before


def test_every_accepted_name_is_listed_signed_and_deleted(http: httpx.Client, model: str) -> None:
    saved: dict[str, str] = {}
    for route, segment in SAVES.items():
        for name in GOOD_NAMES:
            result = th.ok(http, route, {"model_id": model, "path": name})
            assert result["path"] == f"tinker://{model}/{segment}/{name}"
            saved[result["path"]] = f"{segment}/{name}"
    listed = http.get(f"/training_runs/{model}/checkpoints")
    assert listed.status_code == 200, listed.text
    paths = {c["tinker_path"]: c["checkpoint_id"] for c in listed.json()["checkpoints"]}
    assert saved.items() <= paths.items()
    for checkpoint_id in saved.values():
        url = f"/training_runs/{model}/checkpoints/{checkpoint_id}"
        if not checkpoint_id.startswith("weights/"):  # inference checkpoints download
            signed = http.get(f"{url}/external_weights_urls")
            assert signed.status_code == 200, (checkpoint_id, signed.text)
            for link in signed.json()["urls"].values():
                assert httpx.get(link).status_code == 200
        assert http.delete(url).status_code == 200, checkpoint_id
    left = http.get(f"/training_runs/{model}/checkpoints").json()["checkpoints"]
    assert not {c["tinker_path"] for c in left} & saved.keys()

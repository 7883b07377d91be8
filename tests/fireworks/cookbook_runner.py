"""Run one phase of the Fireworks training cookbook's `sft_loop`, `dpo_loop`, `orpo_loop`,
`rl_loop`, `distillation_loop` or `embedding_loop`, unchanged, against the worker at
`FIREWORKS_BASE_URL`.

Executed by the cookbook venv's python (`tests/fireworks/cookbook_venv.py`) with the exported
cookbook tree on `sys.path` (it imports as `training`). Nothing of the cookbook is replaced: the
runner writes small local JSONL data sets in the recipe's formats, builds the recipe's own
`Config` and calls its `main(config)`. The tokenizer is the served model's offline word-level
tokenizer (a local directory: `tokenizer_model`), rendered with the `qwen3_instruct` renderer
named in the config (the recipes infer a renderer from the tokenizer's name otherwise).

Usage: python cookbook_runner.py SPEC_JSON

SPEC_JSON keys:
- cookbook: the directory holding `training/`;
- recipe: `sft`, `dpo`, `orpo` (on the DPO pairs), `embed` (`embedding_loop`, in the mode
  `output_mode` names), `distill` (a teacher deployment scoring the GRPO rows' samples) or
  `rl` (GRPO: a deployment hot-loaded after every step, sampled through the completions
  route; its rows ask a question whose `ground_truth` is one of the tokenizer's
  `<answer>N</answer>` tokens, so a near-uniform tiny model earns a reward now and then and
  its groups get non-zero advantages);
- workdir: the run's directory; `log_path` is `workdir/logs` in every phase, so a resumed phase
  finds the first one's `dataloader.json`;
- tokenizer, base_model, lora_rank, learning_rate, epochs, max_seq_len, and
  dcp_save_interval (default 1: a resumable checkpoint after every step);
- phase: a label (`first`, `resume`), naming the phase's metrics and status files;
- job_id, reference_job_id: the trainer jobs to reattach to (`TrainerConfig`), the cookbook's
  own way to resume (`training/tests/e2e/test_*_resume_e2e.py`);
- keep_reference (dpo): keep a separate reference trainer past the run, for the next phase.
- serverless, output_model_id (sft): train on the serverless surface (`Config.serverless`, the
  cookbook's `training/utils/serverless.py`), and promote the final checkpoint to that model.

Prints one JSON line: `result` (what `main` returned), `metrics` (the recipe's per-step metrics
file), `dataloader` (its `dataloader.json`: checkpoint name -> rows consumed), `checkpoints`
(the control plane's rows for the policy job after the run) and `calls` (the HTTP requests the
SDK's REST client made, `METHOD URL STATUS`). On failure it prints `error` and `traceback` with
the same `calls` instead, and exits 1.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from pathlib import Path
from typing import Any

QUESTION = "what is two plus three ?"
ANSWER, WRONG = "the answer is five .", "the cat sat on a mat ."
ROWS = 8  # two steps of 4 per epoch


def chat(answer: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": answer}]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def sft_data(workdir: Path) -> tuple[str, str]:
    """Chats in OpenAI format, all alike, so every batch measures the same thing; a separate
    eval set, which the recipe scores with `forward` after each epoch."""
    train = write_jsonl(workdir / "sft.jsonl", [{"messages": chat(ANSWER)}] * ROWS)
    evaluation = write_jsonl(workdir / "sft_eval.jsonl", [{"messages": chat(ANSWER)}] * 2)
    return train, evaluation


RL_ANSWER = "<answer>5</answer>"


def rl_data(workdir: Path) -> str:
    """GRPO rows: a user turn and the recipe's `ground_truth`."""
    row = {"messages": [{"role": "user", "content": QUESTION}], "ground_truth": RL_ANSWER}
    return write_jsonl(workdir / "rl.jsonl", [row] * spec_rows(workdir))


def spec_rows(workdir: Path) -> int:
    marker = workdir / "rl_rows"
    return int(marker.read_text()) if marker.exists() else ROWS


def dpo_data(workdir: Path) -> str:
    """Preference pairs in the `{"chosen": {...}, "rejected": {...}}` format: one prompt, a
    right and a wrong answer."""
    pair = {"chosen": {"messages": chat(ANSWER)}, "rejected": {"messages": chat(WRONG)}}
    return write_jsonl(workdir / "dpo.jsonl", [pair] * ROWS)


class CallLog(logging.Handler):
    """The SDK's REST calls, from httpx's own request log lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.calls: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("HTTP Request: "):
            self.calls.append(message.removeprefix("HTTP Request: "))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def control_plane_rows(job_id: str | None) -> list[dict[str, Any]] | str:
    """The control plane's checkpoint rows for `job_id`, as the recipes' resume reads them
    (`FireworksClient.list_checkpoints`; a serverless session's `ts-` id: its session's,
    `list_training_session_checkpoints`); the error text when the listing fails."""
    if not job_id:
        return "no job id"
    import os

    from fireworks.training.sdk import FireworksClient

    try:
        with FireworksClient(
            api_key=os.environ["FIREWORKS_API_KEY"], base_url=os.environ["FIREWORKS_BASE_URL"]
        ) as client:
            if job_id.startswith("ts-"):
                session = f"accounts/{client.account_id}/trainingSessions/{job_id}"
                rows = client.list_training_session_checkpoints(session)
            else:
                rows = client.list_checkpoints(job_id)
    except Exception as exc:  # reported, not raised: the recipe's run is the result
        return f"{type(exc).__name__}: {exc}"
    keys = ("name", "checkpointType", "promotable", "createTime")
    return [{k: row.get(k) for k in keys} for row in rows]


def build_config(spec: dict[str, Any], workdir: Path) -> Any:
    from training.utils import RunnerConfig, TrainerConfig

    log_path = workdir / "logs"
    log_path.mkdir(exist_ok=True)
    phase = spec["phase"]
    common: dict[str, Any] = {
        "log_path": str(log_path),
        "base_model": spec["base_model"],
        "tokenizer_model": spec["tokenizer"],
        "renderer_name": "qwen3_instruct",
        "learning_rate": spec["learning_rate"],
        "epochs": spec["epochs"],
        "batch_size": 4,
        "max_seq_len": spec["max_seq_len"],
        "lora_rank": spec["lora_rank"],
        "dcp_save_interval": spec.get("dcp_save_interval", 1),
        "render_workers": 1,  # render in-process
        "runner": RunnerConfig(
            metrics_file=str(workdir / f"metrics-{phase}.jsonl"),
            status_file=str(workdir / f"status-{phase}.json"),
        ),
    }
    if spec["recipe"] == "sft":
        from training.recipes import sft_loop as recipe

        train, evaluation = sft_data(workdir)
        trainer = TrainerConfig(job_id=spec.get("job_id"))
        return recipe, recipe.Config(
            dataset=train,
            evaluation_dataset=evaluation,
            trainer=trainer,
            serverless=bool(spec.get("serverless")),
            output_model_id=spec.get("output_model_id"),
            **common,
        )

    if spec["recipe"] == "rl":
        return rl_config(spec, workdir, common)

    if spec["recipe"] == "distill":
        return distill_config(spec, workdir, common)

    if spec["recipe"] == "embed":
        return embed_config(spec, workdir, common)

    if spec["recipe"] == "orpo":
        from training.recipes import orpo_loop as recipe  # type: ignore[no-redef]

        orpo = {k: v for k, v in common.items() if k != "render_workers"}
        trainer = TrainerConfig(job_id=spec.get("job_id"))
        return recipe, recipe.Config(dataset=dpo_data(workdir), trainer=trainer, **orpo)

    from training.recipes import dpo_loop as recipe  # type: ignore[no-redef]

    keep = bool(spec.get("keep_reference"))
    trainer = TrainerConfig(
        job_id=spec.get("job_id"),
        reference_job_id=spec.get("reference_job_id"),
        cleanup_reference_on_close=not keep,
    )
    return recipe, recipe.Config(
        dataset=dpo_data(workdir),
        beta=0.1,
        trainer=trainer,
        release_reference_after_cache=not keep,
        **common,
    )


def rl_config(spec: dict[str, Any], workdir: Path, common: dict[str, Any]) -> Any:
    """`rl_loop.Config` with its defaults but what a local run must say: the data, the
    tokenizer directory and renderer, a deployment shape (any string: the managed flow
    refuses a deployment without one), short completions, and the metrics ledger."""
    import os

    from training.recipes import rl_loop as recipe
    from training.utils import DeployConfig

    os.environ["COOKBOOK_METRICS_FILE"] = common["runner"].metrics_file
    (workdir / "rl_rows").write_text(str(spec.get("rows", ROWS)))
    deployment = DeployConfig(
        deployment_shape="accounts/local/deploymentShapes/tiny",
        tokenizer_model=spec["tokenizer"],
    )
    return recipe, recipe.Config(
        log_path=common["log_path"],
        base_model=spec["base_model"],
        dataset=rl_data(workdir),
        learning_rate=spec["learning_rate"],
        max_completion_tokens=spec.get("max_completion_tokens", 12),
        epochs=spec["epochs"],
        max_seq_len=spec["max_seq_len"],
        lora_rank=spec["lora_rank"],
        renderer_name="qwen3_instruct",
        deployment=deployment,
    )


def distill_config(spec: dict[str, Any], workdir: Path, common: dict[str, Any]) -> Any:
    """`distillation_loop.Config` with its defaults but what a local run must say: the data
    (the GRPO rows; the recipe reads their messages), the teacher (`teacher_model`, a base
    model the recipe deploys with the given shape), the tokenizer directory, a deployment
    shape, short completions, and the metrics ledger."""
    import os

    from training.recipes import distillation_loop as recipe
    from training.utils import DeployConfig

    os.environ["COOKBOOK_METRICS_FILE"] = common["runner"].metrics_file
    (workdir / "rl_rows").write_text(str(spec.get("rows", ROWS)))
    shape = "accounts/local/deploymentShapes/tiny"
    return recipe, recipe.Config(
        log_path=common["log_path"],
        base_model=spec["base_model"],
        dataset=rl_data(workdir),
        teacher_model=spec["teacher_model"],
        teacher_deployment_shape=shape,
        learning_rate=spec["learning_rate"],
        completions_per_prompt=2,
        max_completion_tokens=spec.get("max_completion_tokens", 12),
        epochs=spec["epochs"],
        max_seq_len=spec["max_seq_len"],
        lora_rank=spec["lora_rank"],
        deployment=DeployConfig(deployment_shape=shape, tokenizer_model=spec["tokenizer"]),
        runner=common["runner"],
    )


def embed_config(spec: dict[str, Any], workdir: Path, common: dict[str, Any]) -> Any:
    """`embedding_loop.Config` with its defaults but what a local run must say: the
    (query, positive) pairs (4: one batch, so each epoch's step sees the same pairs), the
    tokenizer directory, the output mode, the learning rate and epochs, and the metrics
    ledger."""
    from training.recipes import embedding_loop as recipe

    pairs = [  # words of the served tokenizer
        {"query": "what is two plus three ?", "positive": "the answer is five ."},
        {"query": "hello world ?", "positive": "hello , world ."},
        {"query": "what sat on the mat ?", "positive": "the cat sat on a mat ."},
        {"query": "what is 1 plus 2 ?", "positive": "the answer is 3 ."},
    ]
    return recipe, recipe.Config(
        log_path=common["log_path"],
        base_model=spec["base_model"],
        dataset=write_jsonl(workdir / "pairs.jsonl", pairs),
        tokenizer_model=spec["tokenizer"],
        output_mode=spec["output_mode"],
        temperature=0.05,
        learning_rate=spec["learning_rate"],
        epochs=spec["epochs"],
        batch_size=4,
        max_query_len=32,
        max_doc_len=32,
        lora_rank=spec["lora_rank"],
        runner=common["runner"],
    )


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    sys.path.insert(0, spec["cookbook"])
    workdir = Path(spec["workdir"])
    workdir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    calls = CallLog()
    logging.getLogger("httpx").addHandler(calls)

    out: dict[str, Any] = {"recipe": spec["recipe"], "phase": spec["phase"]}
    try:
        recipe, config = build_config(spec, workdir)
        logging.getLogger("httpx").setLevel(logging.INFO)  # after the imports quieten it
        out["result"] = recipe.main(config)
    except BaseException as exc:  # SystemExit too: the recipes raise it on signals
        out.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    job_id = (out.get("result") or {}).get("job_id") or (out.get("result") or {}).get(
        "policy_job_id"
    )
    out["metrics"] = read_jsonl(workdir / f"metrics-{spec['phase']}.jsonl")
    loader = workdir / "logs" / "dataloader.json"
    out["dataloader"] = json.loads(loader.read_text()) if loader.exists() else {}
    out["checkpoints"] = control_plane_rows(job_id or spec.get("job_id"))
    out["calls"] = calls.calls
    print(json.dumps(out, default=str), flush=True)
    return 1 if "error" in out else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

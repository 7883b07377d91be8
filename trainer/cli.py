"""`trainer <command>`: one argparse subcommand per entry point.

    trainer serve --host 127.0.0.1 --port 8321 --storage DIR --model NAME=PATH_OR_HUB_ID
    trainer serve ... --model NAME=PATH_OR_HUB_ID,max_lora_rank=256   # a model's limits too

Add a command by writing `add_<name>(subparsers)` that registers its parser with
`set_defaults(run=...)`, and listing it in `COMMANDS`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from trainer.contract.options import add_option_flags


def _serve_args(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the RL session API over HTTP",
        description="Serve the RL training-session API (the `together` SDK's post_training).",
    )
    p.add_argument("--config", type=Path, help="TOML file with these settings and model limits")
    p.add_argument("--host", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="TCP port (default 8321)")
    p.add_argument("--storage", type=Path, help="directory for catalogues and checkpoints")
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=PATH_OR_HUB_ID[,KEY=VALUE...]",
        help="a base model to serve (repeatable); KEY=VALUE sets its limits, e.g. "
        "max_lora_rank=256 (trainer.serving.config.MODEL_FLAG_KEYS)",
    )
    p.add_argument("--token-file", type=Path, help="file with the bearer token")
    p.add_argument(
        "--keys",
        type=Path,
        help="TOML file of API keys (per user, by sha256; admins, quotas); re-read on SIGHUP",
    )
    p.add_argument(
        "--no-auth", action="store_true", default=None, help="no token (loopback hosts only)"
    )
    p.add_argument("--resource", type=Path, help="JSON model resource to create at start-up")
    p.add_argument("--session", type=Path, help="JSON session to create once it is READY")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--public-url", help="base URL for signed download/upload URLs")
    p.add_argument(
        "--metrics-port",
        type=int,
        help="also serve /metrics without a key on this port (default: off; admin key on the "
        "main port)",
    )
    p.add_argument("--metrics-host", help="interface of --metrics-port (default 127.0.0.1)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_option_flags(p)
    p.set_defaults(run=_run_serve)


def serve_config(args: argparse.Namespace) -> Any:
    """The TOML file (if any) with the command-line flags laid over it, validated. A key of
    `[engine]`/`[distributed]` set by neither falls back to its legacy environment variable."""
    from trainer.contract.options import fill_from_env, option_overrides, overlay_tables
    from trainer.serving.config import ServeConfig, load_toml, overlay_models

    data: dict[str, Any] = load_toml(args.config) if args.config is not None else {}
    overrides = {
        "host": args.host,
        "port": args.port,
        "storage": args.storage,
        "token_file": args.token_file,
        "keys_file": args.keys,
        "no_auth": args.no_auth,
        "resource_file": args.resource,
        "session_file": args.session,
        "device": args.device,
        "public_url": args.public_url,
        "metrics_port": args.metrics_port,
        "metrics_host": args.metrics_host,
    }
    data.update({k: v for k, v in overrides.items() if v is not None})
    data["model"] = overlay_models(list(data.get("model", [])), args.model)
    fill_from_env(overlay_tables(data, option_overrides(args)))
    return ServeConfig.model_validate(data)


def _run_serve(args: argparse.Namespace) -> int:
    from trainer.api.server import StartupError, serve

    try:
        config = serve_config(args)
    except (ValueError, OSError) as exc:  # ValidationError is a ValueError
        detail = exc if not isinstance(exc, ValidationError) else _validation_text(exc)
        print(f"trainer serve: invalid settings: {detail}", file=sys.stderr)
        return 2
    if not config.models:
        print("trainer serve: no models: pass --model NAME=PATH_OR_HUB_ID", file=sys.stderr)
        return 2
    from trainer.distributed.comm import is_distributed_launch

    start_autograd()
    if is_distributed_launch():
        return _run_serve_distributed(config, args.log_level)
    try:
        return serve(config, log_level=args.log_level)
    except StartupError as exc:
        print(f"trainer serve: {exc}", file=sys.stderr)
        return 2


def start_autograd() -> None:
    """Set up, on the main thread, what torch would otherwise set up lazily on an operation
    thread: the autograd engine's device threads (its first backward) and, on a CUDA build
    of torch without a GPU, the no-op CUDA device guard that DTensor's fake-tensor sharding
    rules install. With torch 2.11's CUDA build on a GPU-less machine, a torchrun rank whose
    first backward, or first DTensor op, ran on an operation thread crashed (SIGSEGV in
    `Engine::start_device_threads`, then in `FakeTensorMode.__enter__`)."""
    import torch

    if torch.backends.cuda.is_built() and not torch.cuda.is_available():
        ensure = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)
        if ensure is not None:
            ensure()
    torch.ones(1, requires_grad=True).sum().backward()


def _run_serve_distributed(config: Any, log_level: str) -> int:
    """Under torchrun: rank 0 serves HTTP and drives every rank; the others execute commands.

    A broken group (a rank died or failed alone) stops rank 0 gracefully, with exit code 1,
    so torchrun's agent tears the job down and restarts it (`--max-restarts`). An agent killed
    outright takes its ranks with it (`leave_with_launcher`).
    """
    import os
    import signal

    import torch.distributed as dist

    from trainer.api.server import StartupError, serve
    from trainer.distributed.comm import leave_with_launcher
    from trainer.distributed.spmd import resource_loader, run_worker

    leave_with_launcher()
    spmd = join_job(config)
    if spmd.comm.rank != 0:
        code = run_worker(spmd)
        if code == 0:
            dist.destroy_process_group()
            return code
        # a broken group: skip interpreter teardown, whose gloo/NCCL destructors can abort
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def stop(reason: str) -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    spmd.on_broken = stop
    try:
        code = serve(config, log_level=log_level, loader=resource_loader(spmd))
    except StartupError as exc:
        print(f"trainer serve: {exc}", file=sys.stderr)
        code = 2
    healthy = spmd.broken is None
    spmd.shutdown()
    if healthy:
        dist.destroy_process_group()
    return code if healthy else 1


def join_job(config: Any) -> Any:
    """This rank's `Spmd` (the command stream), joined with the config's `[distributed]`
    timeout, running the engine with its `[engine]` options and `cpu_offload`."""
    from trainer.distributed.comm import init_distributed
    from trainer.distributed.spmd import Spmd

    comm = init_distributed(config.distributed.collective_timeout_s)
    return Spmd(comm, options=config.engine, cpu_offload=config.distributed.cpu_offload)


def _validation_text(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
    )


def _demo_args(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from trainer import demo

    p = sub.add_parser(
        "demo",
        help="GRPO on a tiny model through the HTTP API (starts its own worker)",
        description=(demo.__doc__ or "").splitlines()[0],
    )
    demo.add_arguments(p)
    p.set_defaults(run=demo.run)


COMMANDS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [
    _serve_args,
    _demo_args,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainer", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(getattr(args, "log_level", "info")).upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    result: int = args.run(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())

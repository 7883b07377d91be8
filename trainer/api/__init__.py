"""The worker's HTTP face: the hosted RL session API, served so the `together` SDK runs unchanged.

Modules, from the edge inward:
- `app`: the FastAPI app (routers under `/v1`, auth, error bodies, lifespan/SIGTERM drain);
- `routes_resources`, `routes_sessions`, `routes_ops`: the endpoints of the contract's Part A;
- `auth`, `signing`, `ids`, `errors`, `requests`, `wire`: token check, signed URLs, safe path
  ids, error bodies, request validation and limits, response shapes;
- `openapi`: the raw-JSON request bodies described in the served schema;
- `checkpoint_errors`: storage failures of checkpoint writes as operation errors;
- `worker`, `lifecycle`, `ops`, `payloads`, `store`: the worker, resource lifecycles,
  per-session FIFO queues, large-payload files and the SQLite catalogue;
- `bodies`: request bodies read off the event loop, large ones parsed in a child process;
- `operations`: the operation table, from which `routes_ops` and the SPMD proxy are derived;
- `engine`: the protocols the engine (`trainer.engine.resource` / `trainer.engine.session`)
satisfies;
- `config`, `server`: settings of `trainer serve` and the process around the app.
"""

from trainer.api.app import create_app
from trainer.serving.config import ServeConfig
from trainer.serving.worker import Worker

__all__ = ["ServeConfig", "Worker", "create_app"]

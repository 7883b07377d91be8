"""HTTP: the FastAPI app (`app`: mounts both faces, auth, lifespan), the process around it
(`server`: token, preload, SIGTERM drain), bearer auth, signed URLs, the raw-JSON bodies of the
served schema (`openapi`) and request helpers (`http`); the two faces are `rl/` (`/v1`, the
together SDK) and `tinker/` (`/api/v1`, the tinker SDK).

It imports `trainer.serving` and below. Neither face imports the other.
"""

from trainer.api.app import create_app

__all__ = ["create_app"]

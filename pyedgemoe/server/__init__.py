"""An OpenAI-compatible HTTP server over one Engine (`pyedgemoe serve`, docs/server.md).

    from pyedgemoe import Engine
    from pyedgemoe.server import create_app
    app = create_app(Engine("model.gguf", expert_cache="25%"), model_id="model.gguf")

Needs the `server` extra (FastAPI, uvicorn): pip install 'pyedgemoe[server]'.
"""
from pyedgemoe.server.app import create_app

__all__ = ["create_app"]

"""An OpenAI-compatible HTTP server over one Engine (`pyedgemoe serve`, docs/server.md).

    from pyedgemoe import Engine
    from pyedgemoe.server import create_app
    app = create_app(Engine("model.gguf", expert_cache="25%"), model_id="model.gguf")

Needs the `server` extra (FastAPI, uvicorn): pip install 'pyedgemoe[server]'.
"""
__all__ = ["create_app"]


def __getattr__(name: str):
    # imported when used: pyedgemoe.server.limits (the CLI's defaults) needs no FastAPI
    if name == "create_app":
        from pyedgemoe.server.app import create_app
        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

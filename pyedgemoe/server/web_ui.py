"""The server's web pages (docs/server.md, "In a browser").

- llama.cpp's own chat UI at / when it is built (`make ui`: the vendored tools/ui sources, Svelte,
  built with npm from their pinned package-lock.json into build/ui/dist), with a link to ours;
  and the llama-server endpoints it asks for besides the OpenAI ones: /props (the server's settings
  and the sampling defaults it shows), /slots (which sequences are busy).
- Our own page, the expert cache live, at /experts (static/experts.html, drawn from
  /metrics/experts); it is / too when llama.cpp's UI is not built.
The pages and their files need no API key (the pages ask for it, as llama-server's UI does).
`serve --no-webui` (llama-server's) serves no page: /props and /slots stay, as there.
"""
from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import version
from pathlib import Path

from fastapi import FastAPI
from starlette.responses import HTMLResponse
from starlette.staticfiles import StaticFiles

from pyedgemoe.chat_template import CHATML, TEMPLATE_KEY
from pyedgemoe.generation import CHAT_TEMPERATURE, SamplingParams

STATIC = Path(__file__).parent / "static"
# where `make ui` puts llama.cpp's UI: the source checkout's build/ (an installed package has none)
BUILT_UI = Path(__file__).resolve().parents[2] / "build" / "ui" / "dist"
_LINK = ('<a href="experts" style="position:fixed;right:14px;bottom:14px;z-index:2147483647;padding:6px 10px;'
         'border-radius:6px;background:#1d2330;color:#fff;font:13px system-ui,sans-serif;text-decoration:none"'
         ' title="pyedgemoe: the expert cache, live">expert cache</a>')
_NO_CACHE = {"Cache-Control": "no-cache"}


class WebUI:
    def __init__(self, ui_dir: Path | None = BUILT_UI, pages: bool = True) -> None:
        self.pages = pages
        self.ui_dir = ui_dir if pages and ui_dir is not None and (ui_dir / "index.html").is_file() else None
        self.experts_page = (STATIC / "experts.html").read_text(encoding="utf-8")
        self.index = self.experts_page
        if self.ui_dir is not None:
            self.index = (self.ui_dir / "index.html").read_text(encoding="utf-8").replace("</body>", _LINK + "</body>", 1)

    def is_public(self, path: str) -> bool:
        """A page or one of its files: open without the API key."""
        if path in ("/", "/experts", "/index.html"):
            return self.pages
        if self.ui_dir is None:
            return False
        try:
            file = (self.ui_dir / path.lstrip("/")).resolve()
            return file.is_relative_to(self.ui_dir.resolve()) and file.is_file()
        except (ValueError, OSError):  # a NUL in the path, a name too long: no file of the UI (it was a 500)
            return False

    def add_routes(self, app: FastAPI, engine, model_id: str, queue, request_defaults: Mapping) -> None:
        """The pages, /props and /slots; llama.cpp's UI files last, under every other path.
        request_defaults: the server's defaults of a request's settings (serve --temp, -n, ...)."""
        defaults = dict(request_defaults)
        n_predict = defaults.pop("max_tokens", None)
        n_predict = -1 if n_predict is None else n_predict
        sampling = SamplingParams.of(defaults, temperature=CHAT_TEMPERATURE)

        if self.pages:
            @app.get("/", include_in_schema=False)
            @app.get("/index.html", include_in_schema=False)
            async def index() -> HTMLResponse:
                return HTMLResponse(self.index, headers=_NO_CACHE)

            @app.get("/experts", include_in_schema=False)
            async def experts() -> HTMLResponse:
                return HTMLResponse(self.experts_page, headers=_NO_CACHE)

        @app.get("/props")
        async def props() -> dict:
            # the sampling settings the UI shows and sends back: those this server takes, at its
            # defaults, else the Engine's chat defaults (n_predict -1: until the end of the turn or the context)
            params = {"n_predict": n_predict, "max_tokens": n_predict, "temperature": sampling.temperature,
                      "top_k": sampling.top_k,
                      "top_p": sampling.top_p, "min_p": sampling.min_p, "typical_p": sampling.typical_p, "repeat_penalty": sampling.repeat_penalty,
                      "frequency_penalty": sampling.frequency_penalty, "presence_penalty": sampling.presence_penalty,
                      "stop": []}
            return {"default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": engine.n_ctx,
                                                    "speculative": engine.draft_model is not None, "is_processing": False,
                                                    "params": params},
                    "total_slots": engine.n_parallel, "model_alias": model_id, "model_path": engine.model_path,
                    "modalities": {"vision": False, "video": False, "audio": False},
                    "endpoint_slots": True, "endpoint_props": False, "endpoint_metrics": True, "ui": self.pages,
                    "chat_template": engine.metadata.get(TEMPLATE_KEY) or CHATML,  # the one in use (llama-server's)
                    "bos_token": _token_text(engine, engine.token_bos()),
                    "eos_token": _token_text(engine, engine.token_eos()),
                    "build_info": f"pyedgemoe {version('pyedgemoe')}", "is_sleeping": False}

        @app.get("/slots")
        async def slots() -> list[dict]:
            return [{"id": i, "n_ctx": engine.n_ctx, "is_processing": i < queue.running}
                    for i in range(engine.n_parallel)]

        if self.ui_dir is not None:
            app.mount("/", StaticFiles(directory=self.ui_dir), name="llama-ui")


def _token_text(engine, token: int | None) -> str:
    return engine.token_piece(token, special=True).decode("utf-8", "replace") if token is not None else ""


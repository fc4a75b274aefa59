"""llama-server's slot actions (pyedgemoe.slot_files), with `serve --slot-save-path PATH`:

    POST /slots/N?action=save     {"filename": "a.bin"} -> {"id_slot", "filename", "n_saved", "n_written", "timings"}
    POST /slots/N?action=restore  {"filename": "a.bin"} -> {"id_slot", "filename", "n_restored", "n_read", "timings"}
    POST /slots/N?action=erase                          -> {"id_slot", "n_erased"}

N is a sequence of the KV cache (0 to --parallel - 1). An action waits its turn with the
generations, and for slot N to be free. Without --slot-save-path, a bad slot, action or filename, a
missing or damaged file, or one of another model or context: a 400 saying so."""
from __future__ import annotations

from fastapi import FastAPI, Request

from pyedgemoe import slot_files
from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.server.openai_errors import APIError, from_engine_error
from pyedgemoe.server.request_params import SLOT_FILE_PARAMETERS, parse_body, parse_fields

ACTIONS = ("save", "restore", "erase")


def add_slot_routes(app: FastAPI, engine, queue, directory: str | None) -> None:
    """The slot actions of the server of engine (queue: its EngineQueue; directory: --slot-save-path)."""

    @app.post("/slots/{id_slot}")
    async def slot_action(id_slot: str, request: Request, action: str = "") -> dict:
        if directory is None:
            raise APIError(400, "this server does not take slot actions: start it with --slot-save-path PATH",
                           "not_supported")
        if not (id_slot.isascii() and id_slot.isdigit() and int(id_slot) < engine.n_parallel):
            raise APIError(400, f"invalid slot {id_slot[:20]!r}: this server has slots 0 to {engine.n_parallel - 1}",
                           "invalid_value", "id_slot")
        if action not in ACTIONS:
            raise APIError(400, f"invalid action {action[:20]!r}: one of {', '.join(ACTIONS)}", "invalid_value",
                           "action")
        raw = await request.body()
        if action == "erase":
            parse_body(raw) if raw.strip() else None  # a body, where given, is JSON
            work = lambda: slot_files.erase(engine, int(id_slot))  # noqa: E731
        else:
            filename = parse_fields(raw, SLOT_FILE_PARAMETERS)["filename"]
            try:
                slot_files.checked_filename(filename)
            except InvalidOptionError as e:
                raise APIError(400, str(e), "invalid_value", "filename") from None
            work = lambda: getattr(slot_files, action)(engine, int(id_slot), directory, filename)  # noqa: E731
        async with queue.turn(request.is_disconnected):
            try:
                return await queue.call(work)
            except Exception as e:  # noqa: BLE001 - shaped as OpenAI's error
                raise from_engine_error(e) from None

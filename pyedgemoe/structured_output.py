"""Structured output: the grammar a generation's text must follow (llama.cpp's grammar sampler).

Three ways to ask, one result (GBNF text for the sampler):
- a GBNF grammar (SamplingParams.grammar; the CLI's --grammar / --grammar-file);
- a JSON schema (SamplingParams.json_schema; --json-schema / --json-schema-file), turned into GBNF
  by llama.cpp's own converter (common/json-schema-to-grammar.cpp, the one behind llama.cpp's
  --json-schema; built into pyedgemoe._native);
- OpenAI's response_format: {"type": "json_object"} is any JSON object (llama.cpp's
  grammars/json.gbnf, as llama-cpp-python), {"type": "json_object", "schema": {...}}
  (llama-cpp-python's JSON schema mode) and {"type": "json_schema", "json_schema": {"schema":
  {...}}} (OpenAI's structured outputs) that schema; {"type": "text"} none.
"""
from __future__ import annotations

import json

from pyedgemoe import _native
from pyedgemoe.errors import InvalidOptionError

JSON_GRAMMAR: str = _native.JSON_GRAMMAR  # any JSON object


def schema_text(schema: str | dict | bool) -> str:
    """A JSON schema as JSON text (a schema given as a dict or bool is dumped)."""
    return schema if isinstance(schema, str) else json.dumps(schema)


def schema_grammar(schema: str) -> str:
    """GBNF for the JSON texts a JSON schema (JSON text) describes; InvalidOptionError, naming
    json_schema, for JSON that does not parse or a schema the converter does not support."""
    try:
        return _native.json_schema_to_grammar(schema)
    except ValueError as e:
        raise InvalidOptionError(f"json_schema: {e}") from None


def response_format_keywords(response_format: dict | None) -> dict:
    """The SamplingParams keywords (grammar or json_schema) an OpenAI response_format asks for."""
    if response_format is None:
        return {}
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        schema = response_format.get("schema")
        return {"grammar": JSON_GRAMMAR} if schema is None else {"json_schema": schema_text(schema)}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise InvalidOptionError("response_format: json_schema must be an object with the schema under 'schema', "
                                     f"got {spec!r}")
        return {"json_schema": schema_text(spec.get("schema", {}))}
    raise InvalidOptionError(f"response_format: type must be 'text', 'json_object' or 'json_schema', "
                             f"got {response_format!r}")

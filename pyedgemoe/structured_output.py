"""Structured output: the grammar a generation's text must follow (llama.cpp's grammar sampler).

Three ways to ask, one result (GBNF text for the sampler):
- a GBNF grammar (SamplingParams.grammar; the CLI's --grammar / --grammar-file);
- a JSON schema (SamplingParams.json_schema; --json-schema / --json-schema-file), turned into GBNF
  by llama.cpp's own converter (common/json-schema-to-grammar.cpp, the one behind llama.cpp's
  --json-schema; built into pyedgemoe._native);
- OpenAI's response_format: {"type": "json_object"} is any JSON object (llama.cpp's
  grammars/json.gbnf, as llama-cpp-python), {"type": "json_object", "schema": {...}}
  (llama-cpp-python's JSON schema mode) and {"type": "json_schema", "json_schema": {"schema":
  {...}}} (OpenAI's structured outputs) that schema (none, or {}: any object, as llama-server's);
  {"type": "text"} none.
"""
from __future__ import annotations

import json

from pyedgemoe import _native
from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.grammar_limits import json_objects, check_grammar, check_schema

JSON_GRAMMAR: str = _native.JSON_GRAMMAR  # any JSON object


def schema_text(schema: str | dict | bool, name: str = "json_schema") -> str:
    """A JSON schema as JSON text (a schema given as a dict or bool is dumped); InvalidOptionError, naming
    name, for anything else."""
    if isinstance(schema, str):
        return schema
    try:
        if isinstance(schema, (dict, bool)):
            return json.dumps(schema)
    except (TypeError, ValueError) as e:  # a value JSON has no text for (bytes, a set)
        raise InvalidOptionError(f"{name}: not JSON: {e}") from None
    raise InvalidOptionError(f"{name} must be a JSON schema (text, a dict or a bool), got {type(schema).__name__}")


def schema_grammar(schema: str, name: str = "json_schema") -> str:
    """GBNF for the JSON texts a JSON schema (JSON text) describes; InvalidOptionError, naming name,
    for JSON that does not parse, a schema the converter does not support, or beyond its limits
    (grammar_limits)."""
    check_schema(schema, name)
    try:
        grammar = _native.json_schema_to_grammar(_closed_tuples(schema))
    except ValueError as e:
        first, *errors = str(e).splitlines()  # llama.cpp's converter: each error on a line of its own
        raise InvalidOptionError(f"{name}: {first} {'; '.join(errors)}".rstrip()) from None
    check_grammar(grammar, name)
    return grammar


def _closed_tuples(schema: str) -> str:
    """The schema without "items": false beside "prefixItems" (a tuple of those items only, as Draft
    2020-12 closes one), which llama.cpp's converter refuses and its tuples are without it."""
    if '"prefixItems"' not in schema:
        return schema
    document = json.loads(schema)
    for node in json_objects(document):
        if "prefixItems" in node and node.get("items") is False:
            del node["items"]
    return json.dumps(document)


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
        # an absent or empty schema is any object, as llama-server takes it (OpenAI's has an object at its root)
        schema = spec.get("schema")
        return {"json_schema": schema_text({"type": "object"} if schema is None or schema == {} else schema)}
    raise InvalidOptionError(f"response_format: type must be 'text', 'json_object' or 'json_schema', "
                             f"got {response_format!r}")

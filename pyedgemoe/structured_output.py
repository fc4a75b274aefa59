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
import re

from pyedgemoe import _native
from pyedgemoe.errors import InvalidOptionError

JSON_GRAMMAR: str = _native.JSON_GRAMMAR  # any JSON object
# llama.cpp's grammar parser and sampler recurse through a grammar's rules and parenthesized groups,
# its JSON-schema converter through a schema's levels: on an 8 MiB stack 20,000 nested groups, a chain
# of 100,000 rules and a schema 10,000 levels deep ended the process. Far beyond any real grammar or schema:
MAX_GRAMMAR_RULES = 5000  # rules and groups together
MAX_SCHEMA_DEPTH = 64  # nested objects and arrays
_GBNF_LITERALS = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|#[^\n]*')  # strings, classes, comments
_JSON_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')


def check_grammar(grammar: str) -> None:
    """InvalidOptionError, naming grammar, for GBNF of more rules and groups than MAX_GRAMMAR_RULES."""
    bare = _GBNF_LITERALS.sub(" ", grammar)
    size = bare.count("::=") + bare.count("(")
    if size > MAX_GRAMMAR_RULES:
        raise InvalidOptionError(f"grammar: {size} rules and parenthesized groups, more than {MAX_GRAMMAR_RULES} (llama.cpp's "
                                 "grammar parser recurses through them)")


def check_schema(schema: str) -> None:
    """InvalidOptionError, naming json_schema, for JSON text nested deeper than MAX_SCHEMA_DEPTH."""
    depth = deepest = 0
    for bracket in re.findall(r"[\[\]{}]", _JSON_STRINGS.sub('""', schema)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    if deepest > MAX_SCHEMA_DEPTH:
        raise InvalidOptionError(f"json_schema: nested {deepest} levels deep, more than {MAX_SCHEMA_DEPTH}")


def schema_text(schema: str | dict | bool) -> str:
    """A JSON schema as JSON text (a schema given as a dict or bool is dumped)."""
    return schema if isinstance(schema, str) else json.dumps(schema)


def schema_grammar(schema: str) -> str:
    """GBNF for the JSON texts a JSON schema (JSON text) describes; InvalidOptionError, naming
    json_schema, for JSON that does not parse or a schema the converter does not support."""
    try:
        return _native.json_schema_to_grammar(schema)
    except ValueError as e:
        first, *errors = str(e).splitlines()  # llama.cpp's converter: each error on a line of its own
        raise InvalidOptionError(f"json_schema: {first} {'; '.join(errors)}".rstrip()) from None


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

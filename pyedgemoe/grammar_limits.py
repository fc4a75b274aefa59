"""What llama.cpp's grammar machinery cannot take, refused before it runs (InvalidOptionError, naming
what was given: "grammar", "json_schema", a tool's parameters).

- llama.cpp's grammar parser and sampler recurse through a grammar's rules and parenthesized groups:
  on an 8 MiB stack 20,000 nested groups and a chain of 100,000 rules ended the process. A schema's
  grammar is checked as a given one is (a chain of 8,000 $refs is a chain of 8,000 rules).
- Its JSON-schema converter recurses through a schema's levels and the $refs it resolves (it runs on
  a thread with a stack for MAX_SCHEMA_DEPTH levels of each of MAX_SCHEMA_REFS $refs with room to
  spare: native/bindings/grammar.cpp), and its time grows with the cube of an object's optional
  properties (1,000: 3.4 s, 256: 0.1 s).
- Bounds no JSON text meets (a minLength above the maxLength): the converter writes a grammar that
  matches nothing or that ignores them; integer bounds beyond 64 bits, which it drops.
"""
from __future__ import annotations

import json
import re

from pyedgemoe.errors import InvalidOptionError

MAX_GRAMMAR_RULES = 5000  # rules and groups together
MAX_SCHEMA_DEPTH = 64  # nested objects and arrays of the JSON text
MAX_SCHEMA_REFS = 1000  # distinct $ref targets
MAX_OPTIONAL_PROPERTIES = 256  # of one object
_GBNF_LITERALS = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|#[^\n]*')  # strings, classes, comments
_JSON_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
# (lower, upper) bounds of one value the converter turns into a grammar
_BOUNDS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minimum", "maximum"))
_INT64 = (-2**63, 2**63 - 1)


def check_grammar(grammar: str, name: str = "grammar") -> None:
    """Refuses GBNF of more rules and groups than MAX_GRAMMAR_RULES."""
    bare = _GBNF_LITERALS.sub(" ", grammar)
    size = bare.count("::=") + bare.count("(")
    if size > MAX_GRAMMAR_RULES:
        raise InvalidOptionError(f"{name}: {size} rules and parenthesized groups, more than {MAX_GRAMMAR_RULES} "
                                 "(llama.cpp's grammar parser recurses through them)")


def check_schema(schema: str, name: str = "json_schema") -> None:
    """Refuses a schema (JSON text) nested deeper than MAX_SCHEMA_DEPTH, of more $ref targets than
    MAX_SCHEMA_REFS or an object of more optional properties than MAX_OPTIONAL_PROPERTIES, with a
    lower bound above its upper bound, or an integer's bound beyond 64 bits. JSON that does not
    parse is left to the converter, which says why."""
    depth = deepest = 0
    for bracket in re.findall(r"[\[\]{}]", _JSON_STRINGS.sub('""', schema)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    if deepest > MAX_SCHEMA_DEPTH:
        raise InvalidOptionError(f"{name}: nested {deepest} levels deep, more than {MAX_SCHEMA_DEPTH}")
    try:
        document = json.loads(schema)
    except ValueError:
        return
    refs: set[str] = set()
    for node in json_objects(document):
        if isinstance(node.get("$ref"), str):
            refs.add(node["$ref"])
        _check_node(node, name)
    if len(refs) > MAX_SCHEMA_REFS:
        raise InvalidOptionError(f"{name}: {len(refs)} $ref targets, more than {MAX_SCHEMA_REFS} (llama.cpp's "
                                 "converter recurses through them)")


def json_objects(document):
    """Every JSON object in document, depth first."""
    stack = [document]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _check_node(node: dict, name: str) -> None:
    properties, required = node.get("properties"), node.get("required")
    if isinstance(properties, dict):
        optional = set(properties) - {r for r in required if isinstance(r, str)} if isinstance(required, list) \
            else set(properties)
        if len(optional) > MAX_OPTIONAL_PROPERTIES:
            raise InvalidOptionError(f"{name}: an object of {len(optional)} optional properties, more than "
                                     f"{MAX_OPTIONAL_PROPERTIES} (llama.cpp's converter takes a time that grows "
                                     "with their cube)")
    number = (int, float)
    for low, high in _BOUNDS:
        lower, upper = node.get(low), node.get(high)
        if isinstance(lower, number) and isinstance(upper, number) and not isinstance(lower, bool) \
                and not isinstance(upper, bool) and lower > upper:
            raise InvalidOptionError(f"{name}: {low} {lower} is above {high} {upper}: no value meets both")
    if node.get("type") == "integer":
        for bound in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            value = node.get(bound)
            if isinstance(value, number) and not isinstance(value, bool) and not _INT64[0] <= value <= _INT64[1]:
                raise InvalidOptionError(f"{name}: an integer's {bound} {value} is beyond 64 bits, which llama.cpp's "
                                         "converter bounds integers to")

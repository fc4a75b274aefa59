"""OpenAI's tools in a chat, as llama-cpp-python's chat formats of a model's own template take them
(the drop-in Llama's way; the Engine's chat and the server parse the calls the model writes, as
llama-server does: pyedgemoe.chat_formats, which leaves a tool choice naming a function to this).

- The tools and the tool choice go to the template (a model's template says how it shows them),
  and the conversation may hold the assistant's earlier tool calls and the tools' answers.
- A tool choice that names a function ({"type": "function", "function": {"name": ...}}, or
  "required" with one tool) forces a call of it: the answer is constrained to a JSON object of the
  function's parameters (its JSON schema, llama.cpp's converter) and comes back as that tool call
  (finish reason "tool_calls"), streamed as pieces of its arguments, in llama-cpp-python's shapes.
- Otherwise ("auto", "none", or none given) the answer is the model's text, as there: a call the
  model writes in its own words is not parsed out of it.
- OpenAI's legacy functions and function_call are these tools and this tool choice (from_functions),
  as llama-cpp-python converts them (but before the template, which then shows them as tools).
"""
from __future__ import annotations

from pyedgemoe.errors import InvalidOptionError
from pyedgemoe.structured_output import schema_grammar, schema_text

TOOL_CHOICES = ("none", "auto", "required")


def check_tools(tools) -> list[dict] | None:
    """tools as given, each an OpenAI function tool with a name (InvalidOptionError otherwise)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidOptionError(f"tools must be a list of tools, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict)
                and isinstance(function.get("name"), str) and function["name"]):
            raise InvalidOptionError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                                     f'"parameters": {{...}}}}}}, got {tool!r}'[:300])
        if not isinstance(function.get("parameters", {}), dict):
            raise InvalidOptionError(f"tools[{i}].function.parameters must be a JSON schema (an object)")
    return tools


def check_tool_choice(tool_choice) -> None:
    """tool_choice as OpenAI takes it: one of TOOL_CHOICES or a function named (InvalidOptionError otherwise)."""
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not (tool_choice is None or tool_choice in TOOL_CHOICES or
            isinstance(function, dict) and isinstance(function.get("name"), str)):
        raise InvalidOptionError(f'tool_choice must be one of {", ".join(TOOL_CHOICES)} or {{"type": "function", '
                                 f'"function": {{"name": ...}}}}, got {tool_choice!r}'[:300])


def from_functions(functions, function_call, tools=None, tool_choice=None) -> tuple[list[dict] | None, object]:
    """(tools, tool_choice), checked: OpenAI's legacy functions ([{"name", "parameters", ...}]) and
    function_call ("none", "auto" or {"name": ...}) as them, else tools and tool_choice as given."""
    if functions is not None or function_call is not None:
        if tools is not None or tool_choice is not None:
            raise InvalidOptionError("give OpenAI's functions and function_call (legacy) or its tools and tool_choice, "
                                     "not both")
        if functions is not None and not isinstance(functions, list):
            raise InvalidOptionError(f"functions must be a list of functions, got {type(functions).__name__}")
        for i, function in enumerate(functions or []):
            if not (isinstance(function, dict) and isinstance(function.get("name"), str) and function["name"]
                    and isinstance(function.get("parameters", {}), dict)):
                raise InvalidOptionError(f'functions[{i}] must be {{"name": ..., "parameters": {{...}}}} (a JSON '
                                         f'schema), got {function!r}'[:300])
        named = isinstance(function_call, dict) and set(function_call) == {"name"} and \
            isinstance(function_call["name"], str)
        if not (function_call in (None, "none", "auto") or named):
            raise InvalidOptionError(f'function_call must be "none", "auto" or {{"name": ...}}, '
                                     f'got {function_call!r}'[:300])
        tools = None if functions is None else [{"type": "function", "function": f} for f in functions]
        tool_choice = {"type": "function", "function": {"name": function_call["name"]}} if named else function_call
    check_tool_choice(tool_choice)
    return check_tools(tools), tool_choice


def forced_tool(tools: list[dict] | None, tool_choice) -> dict | None:
    """The function a tool choice forces a call of, or None."""
    check_tool_choice(tool_choice)
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    if tool_choice == "required":
        if not tools:
            raise InvalidOptionError('tool_choice "required" asks for a call of a tool, and no tools are given')
        if len(tools) != 1:
            raise InvalidOptionError('tool_choice "required" forces a call of the one tool given: with several, '
                                     'name one ({"type": "function", "function": {"name": ...}})')
        return tools[0]["function"]
    name = tool_choice["function"]["name"]
    function = next((t["function"] for t in tools or [] if t["function"]["name"] == name), None)
    if function is None:
        raise InvalidOptionError(f"tool_choice names {name!r}, which is not among the tools")
    return function


def call_grammar(tools: list[dict], function: dict) -> str:
    """The grammar of a forced call's arguments: its function's parameters' schema (none, or {}: any
    object, as OpenAI's arguments are), its errors naming the tool as the request does."""
    i = next(i for i, t in enumerate(tools) if t["function"] is function)
    parameters = function.get("parameters")
    return schema_grammar(schema_text({"type": "object"} if parameters in (None, {}) else parameters),
                          f"tools[{i}].function.parameters")


def tool_call(name: str, arguments: str, call_id: str, index: int | None = None) -> dict:
    """One entry of a message's (or, with index, a stream delta's) tool_calls."""
    return {**({} if index is None else {"index": index}), "id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def call_message(name: str, arguments: str, call_id: str) -> dict:
    """The assistant's message of a forced call (llama-cpp-python's: its legacy function_call too)."""
    return {"role": "assistant", "content": None, "function_call": {"name": name, "arguments": arguments},
            "tool_calls": [tool_call(name, arguments, call_id)]}


# a forced call's stream delta with nothing in it (llama-cpp-python's: every field null)
EMPTY_DELTA = {"role": None, "content": None, "function_call": None, "tool_calls": None}


def call_delta(name: str, arguments: str, call_id: str, named: bool = True) -> dict:
    """A stream chunk's delta of a forced call's next piece of arguments; named: with the call's id
    and name (llama-cpp-python's, in every piece; OpenAI's and llama-server's, in the first alone:
    a client joins the pieces' strings, those too)."""
    if named:
        return {**EMPTY_DELTA, "function_call": {"name": name, "arguments": arguments},
                "tool_calls": [tool_call(name, arguments, call_id, index=0)]}
    return {**EMPTY_DELTA, "function_call": {"arguments": arguments},
            "tool_calls": [{"index": 0, "function": {"arguments": arguments}}]}

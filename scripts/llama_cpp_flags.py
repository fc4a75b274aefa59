"""Writes pyedgemoe/llama_cpp_flags.json: every flag of llama.cpp's tools (the vendored
common/arg.cpp), with its names and whether it takes a value (its handler's second parameter, a
bool's aside), for pyedgemoe.llama_flags.

    .venv/bin/python scripts/llama_cpp_flags.py   # after the vendored llama.cpp changes

tests/test_llama_flags.py checks the file against arg.cpp."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARG_CPP = REPO / "native" / "vendor" / "llama.cpp" / "common" / "arg.cpp"
OUT = REPO / "pyedgemoe" / "llama_cpp_flags.json"
_NAMES = re.compile(r'\s*\{([^}]*)\}(?:\s*,\s*\{([^}]*)\})?')
# its handler: [](common_params & params[, TYPE value]); a value other than a bool is the flag's argument
_HANDLER = re.compile(r'\[\]\s*\(\s*common_params\s*&\s*\w*\s*(?:,([^)]*))?\)')


def flags(text: str) -> list[dict]:
    """Each option of arg.cpp: its names, those of its negation (a negatable one's) and whether it takes a value."""
    out = []
    text = re.sub(r"(?m)^\s*//.*$", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))  # the comments
    for option in text.split("add_opt(common_arg(")[1:]:
        found, handler = _NAMES.match(option), _HANDLER.search(option)
        if not found or not handler:
            continue
        names, negated = (re.findall(r'"(-[^"]+)"', group or "") for group in found.groups())
        second = (handler.group(1) or "").strip()
        out.append({"names": names, "negated": negated, "value": bool(second) and not re.match(r"bool\b", second)})
    return out


def main() -> int:
    OUT.write_text(json.dumps(flags(ARG_CPP.read_text()), indent=0) + "\n")
    print(f"wrote {OUT.relative_to(REPO)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""llama.cpp's logging flags (common/arg.cpp), for every command that loads a model.

pyedgemoe prints its own notes and one-line errors; llama.cpp's log stays silent unless asked:
-v/--verbose (ours: everything on stderr), or any of these, which route it through llama.cpp's own
common log, as its tools do: -lv/--verbosity N (messages up to N: 1 errors, 2 warnings, 3 info,
the default once routed, 4 trace, where llama.cpp's loading messages are, 5 debug), --log-file
FNAME (also written there), --log-colors
on|off|auto, --log-prefix (a level letter before each line), --log-timestamps (the time since the
start, with --log-prefix); --log-disable: no log at all (which is the default here)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from pyedgemoe import _native
from pyedgemoe.errors import InvalidOptionError

VERBOSITY_DEFAULT = 3  # llama.cpp's (LOG_LEVEL_INFO), once its log is routed
VERBOSITY_ALL = 2**31 - 1  # -v's: every message
COLORS = ("on", "off", "auto")

OPTIONS = (
    ("log_disable", bool, typer.Option(False, "--log-disable", help="no llama.cpp log (the default here), as "
                                       "llama.cpp's")),
    ("log_file", Optional[Path], typer.Option(None, "--log-file", help="write llama.cpp's log to FNAME too, as "
                                              "llama.cpp's")),
    ("log_verbosity", Optional[int], typer.Option(None, "-lv", "--verbosity", "--log-verbosity", help="show "
                                                  "llama.cpp's log messages up to N: 1 errors, 2 warnings, 3 info, "
                                                  "4 trace, 5 debug, as llama.cpp's")),
    ("log_colors", Optional[str], typer.Option(None, "--log-colors", help="llama.cpp's log in colors: on, off or "
                                               "auto (on a terminal), as llama.cpp's")),
    ("log_prefix", Optional[bool], typer.Option(None, "--log-prefix/--no-log-prefix", help="a level letter before "
                                                "each line of llama.cpp's log, as llama.cpp's")),
    ("log_timestamps", Optional[bool], typer.Option(None, "--log-timestamps/--no-log-timestamps", help="with "
                                                    "--log-prefix, the time since the start, as llama.cpp's")),
)


def apply(verbose: bool, log_disable: bool, log_file: Path | None, log_verbosity: int | None,
          log_colors: str | None, log_prefix: bool | None, log_timestamps: bool | None) -> bool:
    """Sets up llama.cpp's log as the flags say; the Engine's verbose (False where --log-disable
    silences everything, as llama.cpp's pauses its log)."""
    if log_colors is not None and log_colors not in COLORS:
        raise InvalidOptionError(f"--log-colors takes {', '.join(COLORS)}, got {log_colors!r}")
    if log_verbosity is not None and log_verbosity < 0:
        raise InvalidOptionError(f"--log-verbosity must be >= 0, got {log_verbosity}")
    if log_disable:
        return False
    if log_file is not None:
        try:
            log_file.open("w").close()  # as llama.cpp opens it; a path it cannot write is an error here
        except OSError as e:
            raise InvalidOptionError(f"--log-file: cannot write {log_file}: {e.strerror or e}") from None
    if any(v is not None for v in (log_file, log_verbosity, log_colors, log_prefix, log_timestamps)):
        verbosity = VERBOSITY_ALL if verbose else VERBOSITY_DEFAULT if log_verbosity is None else log_verbosity
        _native.log_to_common(verbosity, str(log_file or ""), log_colors or "auto", bool(log_prefix),
                              bool(log_timestamps))
    return verbose

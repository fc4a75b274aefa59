"""../stand-ins-2026-11-27/sweep.py, its JSON written here: on the copies recalibrated with the drop
costs (build/standin-drop/, ../stand-ins-2026-11-27/cal.py).

    .venv/bin/python docs/bench-runs/stand-ins-2026-11-27b/sweep.py build/standin-drop/demo.gguf,build/standin-drop/fine.gguf 0.25 0.3 0.35 0.4
"""
import sys
from pathlib import Path

script = Path(__file__).parent.parent / "stand-ins-2026-11-27" / "sweep.py"
sys.argv[0] = __file__  # where it writes its JSON (runpy would set it to the script's path)
exec(compile(script.read_text(), str(script), "exec"), {"__name__": "__main__"})

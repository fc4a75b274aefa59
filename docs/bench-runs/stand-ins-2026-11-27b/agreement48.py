"""../stand-ins-2026-11-27/agreement48.py on the copies recalibrated with the drop costs:

    .venv/bin/python docs/bench-runs/stand-ins-2026-11-27b/agreement48.py build/standin-drop/demo.gguf 0.2 0.22
"""
import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).parent.parent / "stand-ins-2026-11-27" / "agreement48.py"), run_name="__main__")

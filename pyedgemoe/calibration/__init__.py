"""Calibration of a model for the runtime (HOBBIT sec. 3.2 and 3.4, docs/mixed-precision.md):

- sidecar: the calibration a model carries (`<model>.calibration.json` or embedded metadata), as
  the Engine and `pyedgemoe convert` read and write it;
- thresholds: selection scores, T1/T2 for a target split, the split achieved;
- replay: a routing trace replayed through the runtime's cache code, the policy-weight search;
- trace: recording a routing trace with an Engine, saving and loading it, what it says on its own;
- run: calibrate(), the four steps from a text to the sidecar.

This file imports none of them: the Engine imports sidecar, and run imports the Engine.
"""

"""Calibrated stand-ins for cache-aware routing (`--stand-in q`, native/src/cache-standin.h).

From each record's layer input h (record_trace's on_inputs, a sequence at a time), per MoE layer:

- cost[e][c]: the mean of ||f_c(h) - f_e(h)|| / ||h|| over the records whose router chose e, f an
  expert's FFN computed from the GGUF's HIGH copies (records with h = 0, as a zero BOS embedding
  gives, are left out);
- drop_cost[e]: the mean of ||f_e(h)|| / ||h|| over the same records, what leaving the selection
  out costs;
- the quantiles of the calibration's own swap costs w_e * min(drop_cost[e], min_c cost[e][c]) (w_e
  the selection's routing weight, c among the experts the token did not choose), from which
  `--stand-in q` takes the layer's bound tau (taus).

The expert FFN here is the gated SiLU one, down(silu(gate h) * up h): what the architectures of
GATED_SILU compute. Each expert is read from the file and dequantized on its own, twice per chunk of
records (once for the chosen experts' outputs, once against them), so memory holds one expert (as
float32), one sequence's layer inputs and a chunk's chosen outputs (CHUNK_FLOATS), never a layer's
experts nor the whole text's inputs.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from pyedgemoe.calibration.sidecar import QUANTILE_POINTS
from pyedgemoe.convert.from_gguf import GGUFSource, dequantized_rows, open_gguf, tensor_ne
from pyedgemoe.errors import InvalidOptionError

# llama.cpp architectures whose routed experts are gated SiLU FFNs without biases
GATED_SILU = ("qwen3moe", "qwen2moe", "olmoe", "llama", "deepseek2", "phimoe", "granitemoe")
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
CHUNK_FLOATS = 1 << 25  # the chosen experts' outputs of a chunk of records (128 MiB)


def _layer_tensors(tensors: dict, il: int) -> list:
    """Layer il's gate, up [E, f, d] and down [E, d, f] expert tensors (the HIGH copies; tensors:
    the GGUF's by name)."""
    out = []
    for name in EXPERT_TENSORS:
        t = tensors.get(f"blk.{il}.{name}.weight")
        if t is None:
            raise InvalidOptionError(f"stand-ins need separate gate, up and down experts: layer {il} has no {name}")
        out.append(t)
    return out


def _expert_output(model: GGUFSource, layer: list, e: int, h: np.ndarray) -> np.ndarray:
    """Expert e's output on each row of h [m, d]: [m, d]."""
    gate, up, down = (dequantized_rows(model.file_of(t), t, e * tensor_ne(t)[1], (e + 1) * tensor_ne(t)[1])
                      for t in layer)
    g = h @ gate.T
    with np.errstate(over="ignore"):  # exp of a large -g is inf, and g / inf the 0 that SiLU gives there
        a = g / (1 + np.exp(-g)) * (h @ up.T)
    return a @ down.T


class StandInCosts:
    """The stand-ins' sums over the records seen so far, one part of a trace at a time (record_trace's
    on_inputs: one sequence's layer inputs in memory at once); result() the costs and quantiles.
    InvalidOptionError for an architecture whose experts are not gated SiLU FFNs."""

    def __init__(self, model_path: str | os.PathLike, architecture: str):
        if architecture not in GATED_SILU:
            raise InvalidOptionError(f"stand-ins compute the experts as gated SiLU FFNs, of the architectures "
                                     f"checked to have them ({', '.join(GATED_SILU)}): not {architecture}")
        self.model = open_gguf(Path(model_path), "model")
        self.tensors = {t.name: t for t in self.model.tensors}
        self.sums: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # il: (total [E, E], count, dropping [E])
        self.measured: list[np.ndarray] = []  # per part, its records with a non-zero input
        self.seconds = 0.0

    def add(self, part: dict) -> None:
        """Adds a part of a trace (layer, ids and its records' "inputs" [n, n_embd])."""
        start = time.perf_counter()
        layer, ids = np.asarray(part["layer"]), np.asarray(part["ids"])
        inputs = np.asarray(part["inputs"], dtype=np.float32)
        norms = np.linalg.norm(inputs, axis=1)
        self.measured.append(norms > 0)
        n_embd, k = inputs.shape[1], ids.shape[1]
        for il in (int(l) for l in np.unique(layer)):
            experts = _layer_tensors(self.tensors, il)
            n_expert = tensor_ne(experts[0])[2]
            total, count, dropping = self.sums.setdefault(
                il, (np.zeros((n_expert, n_expert)), np.zeros(n_expert), np.zeros(n_expert)))
            rows = np.flatnonzero((layer == il) & (norms > 0))
            chunk = max(1, CHUNK_FLOATS // (k * n_embd))
            for first in range(0, len(rows), chunk):
                r = rows[first:first + chunk]
                h, sel = inputs[r], ids[r]
                chosen = np.empty((len(r), k, n_embd), dtype=np.float32)  # each record's chosen experts' outputs
                for e in np.unique(sel):
                    at = np.nonzero(sel == e)
                    chosen[at] = _expert_output(self.model, experts, int(e), h[at[0]])
                for c in range(n_expert):
                    f = _expert_output(self.model, experts, c, h)
                    dist = np.stack([np.linalg.norm(f - chosen[:, j], axis=1) for j in range(k)], axis=1) / norms[r][:, None]
                    total[:, c] += np.bincount(sel.ravel(), weights=dist.ravel(), minlength=n_expert)
                count += np.bincount(sel.ravel(), minlength=n_expert)
                dropping += np.bincount(sel.ravel(), weights=(np.linalg.norm(chosen, axis=2) / norms[r][:, None]).ravel(),
                                        minlength=n_expert)
        self.seconds += time.perf_counter() - start

    def result(self, trace: dict) -> dict:
        """{"layers": {il: {"cost": [E][E], "drop_cost": [E], "swap_cost_quantiles": [QUANTILE_POINTS]}},
        "records": n} from the sums and the whole trace's routing (the parts added, in order)."""
        start = time.perf_counter()
        layer, ids = np.asarray(trace["layer"]), np.asarray(trace["ids"])
        weights, k = np.asarray(trace["weights"], dtype=np.float32), ids.shape[1]
        measured = np.concatenate(self.measured) if self.measured else np.zeros(0, dtype=bool)
        layers = {}
        for il, (total, count, dropping) in sorted(self.sums.items()):
            cost, drop = total / np.maximum(count, 1)[:, None], dropping / np.maximum(count, 1)
            # the calibration's own swap costs: each selection's cheapest way out, a stand-in among
            # the unchosen or none
            rows = np.flatnonzero((layer == il) & measured)
            sel = ids[rows]
            c = np.concatenate([cost[sel], drop[sel][:, :, None]], axis=2) * weights[rows][:, :, None]  # [m, k, E + 1]
            np.put_along_axis(c, np.broadcast_to(sel[:, None, :], sel.shape + (k,)), np.inf, axis=2)
            swap = c.min(axis=2).ravel()
            swap = swap[np.isfinite(swap)]
            quantiles = np.quantile(swap, np.linspace(0, 1, QUANTILE_POINTS)) if len(swap) else np.zeros(QUANTILE_POINTS)
            layers[str(il)] = {"cost": np.round(cost, 6).tolist(), "drop_cost": np.round(drop, 6).tolist(),
                               "swap_cost_quantiles": np.round(quantiles, 6).tolist()}
        self.seconds += time.perf_counter() - start
        return {"layers": layers, "records": int(measured.sum())}


def taus(stand_ins: dict, q: float) -> dict[int, tuple[list[float], list[float], float]]:
    """What the runtime takes for --stand-in q: {layer: (its costs row-major, its drop costs (none in
    a sidecar from before they were measured: nothing is dropped), tau = the q-quantile of its
    calibration's swap costs)}."""
    points = np.linspace(0, 1, QUANTILE_POINTS)
    return {int(il): ([float(x) for row in t["cost"] for x in row], [float(x) for x in t.get("drop_cost", [])],
                      float(np.interp(q, points, t["swap_cost_quantiles"])))
            for il, t in stand_ins["layers"].items()}

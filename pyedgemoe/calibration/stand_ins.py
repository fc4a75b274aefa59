"""Calibrated stand-ins for cache-aware routing (`--stand-in q`, native/src/cache-standin.h).

From a routing trace that holds each record's layer input h (record_trace(..., inputs=True)), per
MoE layer:

- cost[e][c]: the mean of ||f_c(h) - f_e(h)|| / ||h|| over the records whose router chose e, f an
  expert's FFN computed from the GGUF's HIGH copies (records with h = 0, as a zero BOS embedding
  gives, are left out);
- the quantiles of the calibration's own swap costs w_e * min_c cost[e][c] (w_e the selection's
  routing weight, c among the experts the token did not choose), from which `--stand-in q` takes the
  layer's bound tau (taus).

The expert FFN here is the gated SiLU one, down(silu(gate h) * up h): what the architectures of
GATED_SILU compute. Memory: one layer's expert weights (as float32) and a chunk of records at a time.
"""
from __future__ import annotations

import numpy as np

from pyedgemoe.errors import InvalidOptionError

# llama.cpp architectures whose routed experts are gated SiLU FFNs without biases
GATED_SILU = ("qwen3moe", "qwen2moe", "olmoe", "llama", "deepseek2", "phimoe", "granitemoe")
QUANTILE_POINTS = 101  # the swap costs' quantiles at 0, 0.01, ..., 1
CHUNK_FLOATS = 1 << 24  # the distances of a chunk of records at once


def _expert_weights(tensors: dict, il: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Layer il's gate, up [E, f, d] and down [E, d, f] as float32 (the HIGH copies; tensors: the
    GGUF's by name)."""
    from gguf.quants import dequantize

    out = []
    for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        t = tensors.get(f"blk.{il}.{name}.weight")
        if t is None:
            raise InvalidOptionError(f"stand-ins need separate gate, up and down experts: layer {il} has no {name}")
        out.append(np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32))
    return out[0], out[1], out[2]


def _outputs(gate: np.ndarray, up: np.ndarray, down: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Every expert's output on each row of h [m, d]: [E, m, d]."""
    g, u = np.einsum("efd,md->emf", gate, h), np.einsum("efd,md->emf", up, h)
    return np.einsum("edf,emf->emd", down, g / (1 + np.exp(-g)) * u)


def stand_in_costs(model_path: str, architecture: str, trace: dict) -> dict:
    """{"layers": {il: {"cost": [E][E], "swap_cost_quantiles": [QUANTILE_POINTS]}}, "records": n}
    from a trace with "inputs". InvalidOptionError for an architecture whose experts are not gated
    SiLU FFNs."""
    import gguf

    if architecture not in GATED_SILU:
        raise InvalidOptionError(f"stand-ins compute the experts as gated SiLU FFNs, which {architecture}'s are not")
    if "inputs" not in trace:
        raise InvalidOptionError("stand-ins need a trace recorded with the layers' inputs")
    tensors = {t.name: t for t in gguf.GGUFReader(model_path).tensors}
    layer, ids = np.asarray(trace["layer"]), np.asarray(trace["ids"])
    weights, inputs = np.asarray(trace["weights"], dtype=np.float32), np.asarray(trace["inputs"], dtype=np.float32)
    norms = np.linalg.norm(inputs, axis=1)
    layers, used = {}, 0
    for il in (int(l) for l in np.unique(layer)):
        gate, up, down = _expert_weights(tensors, il)
        n_expert, k = gate.shape[0], ids.shape[1]
        rows = np.flatnonzero((layer == il) & (norms > 0))
        total, count = np.zeros((n_expert, n_expert)), np.zeros(n_expert)
        chunk = max(1, CHUNK_FLOATS // (n_expert * k * inputs.shape[1]))
        for start in range(0, len(rows), chunk):
            r = rows[start:start + chunk]
            f = _outputs(gate, up, down, inputs[r])  # [E, m, d]
            chosen = f[ids[r], np.arange(len(r))[:, None]]  # [m, k, d]: the chosen experts' outputs
            dist = np.linalg.norm(f[:, :, None, :] - chosen[None], axis=-1) / norms[r][None, :, None]  # [E(c), m, k]
            np.add.at(total, ids[r].ravel(), dist.transpose(1, 2, 0).reshape(-1, n_expert))
            np.add.at(count, ids[r].ravel(), 1)
        cost = total / np.maximum(count, 1)[:, None]
        # the calibration's own swap costs: each selection's cheapest stand-in among the unchosen
        sel = ids[rows]
        c = cost[sel] * weights[rows][:, :, None]  # [m, k, E]
        np.put_along_axis(c, np.broadcast_to(sel[:, None, :], sel.shape + (k,)), np.inf, axis=2)
        swap = c.min(axis=2).ravel()
        swap = swap[np.isfinite(swap)]
        quantiles = np.quantile(swap, np.linspace(0, 1, QUANTILE_POINTS)) if len(swap) else np.zeros(QUANTILE_POINTS)
        layers[str(il)] = {"cost": np.round(cost, 6).tolist(), "swap_cost_quantiles": np.round(quantiles, 6).tolist()}
        used += len(rows)
    return {"layers": layers, "records": used}


def taus(stand_ins: dict, q: float) -> dict[int, tuple[list[float], float]]:
    """What the runtime takes for --stand-in q: {layer: (its costs row-major, tau = the q-quantile of
    its calibration's swap costs)}."""
    points = np.linspace(0, 1, QUANTILE_POINTS)
    return {int(il): ([float(x) for row in t["cost"] for x in row], float(np.interp(q, points, t["swap_cost_quantiles"])))
            for il, t in stand_ins["layers"].items()}

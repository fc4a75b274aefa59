"""The whole calibration of a model (HOBBIT sec. 3.2 and 3.4): thresholds T1/T2 and cache-policy
weights from the routing trace of a text under an expert cache budget, written to the sidecar
that the Engine reads (docs/mixed-precision.md).

    from pyedgemoe.calibration.run import calibrate
    result = calibrate("model.gguf", open("text.txt").read(), budget="25%")
    print(result.t1, result.t2, result.policy_weights)   # also in model.gguf.calibration.json

Four steps, each in a module of its own:

1. trace.record_trace: the model runs the text with the expert cache it will run with (the
   budget), one token per ubatch, in sequences of n_ctx tokens, recording every MoE layer's
   routing. While recording, t1 = t2 = 1 (every selection HIGH), so the routing is the model's own,
   not bent by LOW copies or skipped experts, and the cache has the HIGH/LOW slot split that `run`
   gets for the same budget.
2. thresholds.choose_thresholds: T1/T2 at the quantiles of the selections' scores that give the
   target split (default: thresholds.default_split of the model's top-k).
3. replay.replay_steps: the trace as the runtime's place() calls, with each selection's demand
   under T1/T2.
4. replay.search_policy_weights: the hobbit weights with the lowest miss penalty when those calls
   are replayed through the runtime's cache code, and the single policies to compare.

Besides, from the same trace: EdgeMoE's path statistics (paths.py; `--prefetch edgemoe` reads
them), with system="edgemoe" EdgeMoE's static precision map (edgemoe.py; `--static-precision`) and
with system="mobile" MoBiLE's gamma (mobile.py; `--system mobile`'s `--big-little`).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace

import numpy as np

from pyedgemoe.calibration import edgemoe, mobile, stand_ins as stand_in_stats
from pyedgemoe.calibration.paths import path_accuracy, path_statistics
from pyedgemoe.calibration.replay import (DEFAULT_GRID_STEP, CacheSetup, ReplayResult, against_min,
                                          best_lossless_policy, replay_steps, search_policy_weights, weight_grid)
from pyedgemoe.calibration.sidecar import SIDECAR_VERSION, of_the_model, read_sidecar, sidecar_path, write_sidecar
from pyedgemoe.calibration.thresholds import (choose_thresholds, default_split, parse_split,
                                              precision_demands, split_of)
from pyedgemoe.calibration.trace import (expert_usage, prediction_accuracy, record_trace, save_trace,
                                         trace_path)
from pyedgemoe.engine import Engine
from pyedgemoe.errors import InvalidOptionError, TextTooShortError
from pyedgemoe.memory_budget import MAPPED
from pyedgemoe.model_info import ModelInfo, read_model_info
from pyedgemoe.output_files import check_output

DEFAULT_BUDGET = "25%"
DEFAULT_N_CTX = 512
DEFAULT_MAX_TOKENS = 2048
MIN_TOKENS = 64  # fewer tokens give too few selections for quantiles and too short a replay


@dataclass
class CalibrationResult:
    """The sidecar's contents (to_dict) and where it and the trace were written."""
    data: dict
    sidecar: str | None = None
    trace: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def t1(self) -> float:
        return self.data["t1"]

    @property
    def t2(self) -> float:
        return self.data["t2"]

    @property
    def policy_weights(self) -> list[float]:
        return self.data["policy_weights"]

    def to_dict(self) -> dict:
        return {**self.data, "sidecar_path": self.sidecar, "trace_path": self.trace}


# the Engine arguments of the calibration run, set by calibrate (below)
CALIBRATION_RUN = ("n_ctx", "n_batch", "expert_cache", "t1", "t2", "fill_cache", "trace_routing")
ROUTING_CHANGES = ("cache_routing", "stand_in", "big_little")  # options a run routes otherwise by


def calibrate(model_path: str | os.PathLike, text: str, *, budget: str | int = DEFAULT_BUDGET,
              split=None, n_ctx: int = DEFAULT_N_CTX, max_tokens: int | None = DEFAULT_MAX_TOKENS,
              trace: str | os.PathLike | None = None, sidecar: str | os.PathLike | None = None,
              grid_step: float = DEFAULT_GRID_STEP, text_name: str | None = None, write: bool = True,
              system: str | None = None, loss_budget: float = edgemoe.DEFAULT_LOSS_BUDGET,
              min_agreement: float = edgemoe.DEFAULT_MIN_AGREEMENT,
              size_budget: float | None = None, force: bool = False, stand_ins: bool = False,
              **engine_options) -> CalibrationResult:
    """Calibrates the model on text under an expert cache of `budget` and writes the trace (default
    `<model>.routing-trace.npz`) and the sidecar (default `<model>.calibration.json`). A sidecar
    there already is an InvalidOptionError unless force: then it is replaced, keeping EdgeMoE's
    precision map from it unless system="edgemoe" computes it again (its importance profile takes
    the longest, and nothing else here changes it).

    split: target shares of selections (high, low, skip; None: default_split of the model's top-k). n_ctx: tokens per sequence. max_tokens:
    use at most this many tokens of the text (None: all). system: "hobbit" (the default: the above)
    or "edgemoe" (also the static precision map for loss_budget and min_agreement, or size_budget:
    edgemoe.py) or "mobile" (also MoBiLE's gamma for min_agreement and loss_budget: mobile.py).
    stand_ins: also the calibrated stand-ins that `--stand-in` routes by (stand_ins.py).
    engine_options: further Engine arguments
    (n_threads, verbose, expert_options and the expert options by name). Raises InvalidOptionError
    for a dense model, a bad split or budget, TextTooShortError for fewer than MIN_TOKENS tokens.
    """
    split = None if split is None else parse_split(split)
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 2:
        raise InvalidOptionError(f"n_ctx must be an integer >= 2, got {n_ctx!r}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < MIN_TOKENS):
        raise InvalidOptionError(f"max_tokens must be an integer >= {MIN_TOKENS}, got {max_tokens!r}")
    model_path = os.fspath(model_path)
    info = read_model_info(model_path)
    if not info.is_moe:
        raise InvalidOptionError(f"{model_path} has no experts ({info.architecture} is dense): nothing to calibrate")
    if budget is None or (isinstance(budget, str) and budget.strip().lower() in ("auto", MAPPED)):
        raise InvalidOptionError("calibration needs an expert cache budget (a size or a share, e.g. 25%), not "
                                 f"{budget!r}")
    weight_grid(grid_step)  # a bad step fails before the model runs, and so does a bad bound
    edgemoe.check_bounds(loss_budget, min_agreement, size_budget)
    given = set(engine_options) | set(getattr(engine_options.get("expert_options"), "given", ()))
    taken = [name for name in CALIBRATION_RUN if name in given]
    if taken:
        raise InvalidOptionError(f"calibrate sets {', '.join(taken)} itself (the cache is budget=, and t1 = t2 = 1 "
                                 "record the model's own routing)")
    rerouted = [name for name in ROUTING_CHANGES if name in given]
    if rerouted:
        raise InvalidOptionError(f"calibrate records the model's own routing: {', '.join(rerouted)} would change it")
    sidecar = os.fspath(sidecar if sidecar is not None else sidecar_path(model_path))
    trace = os.fspath(trace if trace is not None else trace_path(model_path))
    notes: list[str] = []
    if write:
        _check_outputs(model_path, trace, sidecar)
    previous = _previous_calibration(sidecar, force, info, notes) if write else None
    if system not in (None, "hobbit", "edgemoe", "mobile"):
        raise InvalidOptionError(f"calibrate --system takes hobbit, edgemoe or mobile, got {system!r} (fate needs "
                                 "no calibration; lossless has nothing to calibrate)")

    # refused before the model runs: an architecture whose experts the stand-ins cannot compute
    stand_in_costs = stand_in_stats.StandInCosts(model_path, info.architecture) if stand_ins else None
    if size_budget is not None and system != "edgemoe":
        notes.append("the size budget is --system edgemoe's: unused")
    if system not in ("edgemoe", "mobile") and (loss_budget, min_agreement) != (edgemoe.DEFAULT_LOSS_BUDGET,
                                                                               edgemoe.DEFAULT_MIN_AGREEMENT):
        notes.append("the loss budget and the agreement bound are --system edgemoe's and mobile's: unused")
    start = time.perf_counter()
    # t1 = t2 = 1: every selection HIGH, so the routing recorded is the model's own (module doc);
    # an empty cache at the start, as in the replay
    with Engine(model_path, n_ctx=n_ctx, n_batch=1, expert_cache=budget, t1=1.0, t2=1.0,
                fill_cache=False, trace_routing=True, **engine_options) as eng:
        tokens = eng.first_tokens(text, max_tokens)
        if len(tokens) < MIN_TOKENS:
            raise TextTooShortError(f"calibration needs at least {MIN_TOKENS} tokens of text, "
                                    f"the text has only {len(tokens)}")
        residency = dict(eng.expert_residency)
        routing = record_trace(eng, tokens, n_ctx, on_inputs=stand_in_costs.add if stand_in_costs else None)
        # where the LOW copies came from, as the model's directory sees it: the sidecar travels with the model
        low_source = residency.get("low_source") or None
        if low_source:
            low_source = os.path.relpath(os.path.abspath(low_source), os.path.dirname(os.path.abspath(model_path)))
    record_seconds = time.perf_counter() - start - (stand_in_costs.seconds if stand_in_costs else 0.0)

    k = residency["n_expert_used"]
    split = default_split(k) if split is None else split
    weights = np.asarray(routing["weights"], dtype=np.float32)
    t1, t2 = choose_thresholds(weights, split)
    achieved = split_of(precision_demands(weights, t1, t2))
    if not residency["mixed_precision"] and info.expert_biases:
        notes.append(f"{info.architecture}'s experts have biases, which a pass per precision would add twice: "
                     "low precision stays off, the thresholds take effect with --skip alone, and the replay loads "
                     "everything in HIGH")
    elif not residency["mixed_precision"] and (info.multi_precision or "low_from" in given):
        notes.append("low precision is off in this run (the budget, or --no-low-precision): the replay loads "
                     "everything in HIGH")
    elif not residency["mixed_precision"]:
        notes.append("the model has no LOW expert copies: the thresholds take effect with --low-from "
                     "(or a multi-precision GGUF); the replay loads everything in HIGH")
    if k == 1:
        notes.append("top-1 routing: every selection is HIGH, the thresholds have no effect")
    groups = {(info.high_expert_bytes_per_layer.get(l), info.low_expert_bytes_per_layer.get(l))
              for l in info.expert_bytes_per_layer}
    if len(groups) > 1:
        notes.append(f"the MoE layers have {len(groups)} expert shapes (slot pool groups); the replay "
                     "approximates them with one pool of all slots")

    steps = replay_steps(routing, t1, t2, use_low=residency["mixed_precision"], use_skip=residency["skip"])
    low_cost = residency["low_expert_bytes"] / residency["expert_bytes"] if residency["mixed_precision"] else 0.0
    setup = CacheSetup(high_slots=residency["high_slots"], low_slots=residency["low_slots"],
                       n_layers=residency["n_layers"], low_cost=low_cost,
                       low_serves_high=residency["low_hit"] == "accept",
                       layers=tuple(sorted(info.expert_bytes_per_layer)), n_expert=residency["n_expert"],
                       n_expert_used=k)
    replay_start = time.perf_counter()
    best, singles = search_policy_weights(steps, setup, grid_step)
    replay_seconds = time.perf_counter() - replay_start
    ranked = sorted([best, *singles.values()], key=ReplayResult.rank_key)
    if best.failures:
        notes.append(f"the runtime's cache cannot serve {best.failures} layer(s) of this trace even with the best "
                     "weights (a tier runs out of evictable slots): such a decode fails; use a larger budget")
    winner = ranked[0]
    if winner.policy != "hobbit" and winner.rank_key() < best.rank_key():
        why = (f"{winner.failures} failures against {best.failures}" if winner.failures != best.failures
               else f"miss penalty {winner.penalty:.1f} against {best.penalty:.1f}")
        notes.append(f"the {winner.policy} policy alone does better than the best hobbit weights ({why}): "
                     "runs with LOW copies use it unless --cache-policy or a --system names another")

    # lossless, against the offline optimum: every byte of the budget in HIGH slots
    lossless = replace(setup, high_slots=lossless_slots(residency), low_slots=0)
    against = against_min(replay_steps(routing, t1, t2, use_low=False, use_skip=False), lossless, best.weights)

    n_sequences = int(routing["sequence"].max()) + 1 if len(routing["sequence"]) else 0
    data = {
        "version": SIDECAR_VERSION,
        "t1": t1,
        "t2": t2,
        "policy_weights": [float(w) for w in best.weights],
        "best_policy": winner.policy,
        "best_lossless_policy": best_lossless_policy(against["policies"]),
        "target_split": dict(zip(("high", "low", "skip"), split)),
        "achieved_split": achieved,
        "n_experts_used": k,
        "penalties": {"hobbit": best.to_dict(), **{p: r.to_dict() for p, r in singles.items()}},
        "lossless_against_min": against,
        "grid_step": grid_step,
        "budget": str(budget),
        "budget_bytes": residency["budget_bytes"],
        "high_slots": residency["high_slots"],
        "low_slots": residency["low_slots"],
        "low_cost": low_cost,
        "low_hit": residency["low_hit"],
        "low_source": low_source,
        "mixed_precision": residency["mixed_precision"],
        "text": os.path.basename(text_name) if text_name else None,
        "n_tokens": len(tokens),
        "n_ctx": n_ctx,
        "n_sequences": n_sequences,
        "expert_usage": expert_usage(routing, residency["n_expert"]),
        "seconds": {"record": record_seconds, "replay": replay_seconds},
        "notes": notes,
    }
    accuracy = prediction_accuracy(routing)
    if accuracy is not None:
        data["prediction"] = accuracy
    data["path_statistics"] = path_statistics(routing, residency["n_expert"])
    data["path_accuracy"] = path_accuracy(data["path_statistics"], routing)
    if system == "edgemoe":
        start = time.perf_counter()
        data["precision_map"] = edgemoe.precision_map(model_path, tokens, loss_budget=loss_budget,
                                                      min_agreement=min_agreement, size_budget=size_budget,
                                                      n_ctx=n_ctx, **engine_options)
        data["seconds"]["precision_map"] = time.perf_counter() - start
    elif previous and previous.get("precision_map"):
        data["precision_map"] = previous["precision_map"]
        notes.append(f"kept EdgeMoE's precision map of the sidecar replaced ({previous['precision_map']['n_low']} "
                     "experts LOW; --system edgemoe computes it again)")
    if system == "mobile":
        start = time.perf_counter()
        data["big_little"] = mobile.calibrate_gamma(model_path, tokens, budget, min_agreement=min_agreement,
                                                    loss_budget=loss_budget, n_ctx=n_ctx, **engine_options)
        data["seconds"]["big_little"] = time.perf_counter() - start
    elif previous and previous.get("big_little"):
        data["big_little"] = previous["big_little"]
        notes.append(f"kept MoBiLE's gamma of the sidecar replaced ({previous['big_little']['gamma']:.3g}; "
                     "--system mobile computes it again)")
    if stand_in_costs:
        data["stand_ins"] = stand_in_costs.result(routing)
        data["seconds"]["stand_ins"] = stand_in_costs.seconds
    elif previous and previous.get("stand_ins"):
        data["stand_ins"] = previous["stand_ins"]
        notes.append("kept the stand-ins of the sidecar replaced (--stand-ins computes them again)")
    result = CalibrationResult(data, notes=notes)
    if write:
        result.trace = save_trace(routing, trace)
        result.sidecar = write_sidecar(data, sidecar)
    return result


def lossless_slots(residency: dict) -> int:
    """The HIGH slots the whole budget of an Engine's expert residency holds (no LOW tier)."""
    return residency["budget_bytes"] // (residency["high_pool_bytes"] // residency["high_slots"])


def _previous_calibration(sidecar: str, force: bool, info: ModelInfo, notes: list[str]) -> dict | None:
    """The sidecar a calibration would replace (None: none); without force, an InvalidOptionError:
    it is not replaced silently. One that cannot be read (damaged, another model's) is removed, so
    that the runs here load without it (a note says so)."""
    if not os.path.exists(sidecar):
        return None
    if not force:
        raise InvalidOptionError(f"{sidecar} exists: calibrate with --force (force=True from Python) to replace it "
                                 "(EdgeMoE's precision map in it is kept unless --system edgemoe computes it again, "
                                 "and so are its stand-ins unless --stand-ins does)")
    try:
        return of_the_model(read_sidecar(sidecar), info.metadata, f"calibration sidecar {sidecar}")
    except InvalidOptionError as e:
        os.unlink(sidecar)
        notes.append(f"removed the sidecar replaced, which could not be used: {e}")
        return None


def _check_outputs(model_path: str, trace: str, sidecar: str) -> None:
    """Refused before the model runs: a trace or sidecar that would overwrite the model or each other,
    or cannot be written where it is to go."""
    if len({os.path.realpath(p) for p in (model_path, trace, sidecar)}) < 3:
        raise InvalidOptionError(f"the trace ({trace}) and the sidecar ({sidecar}) must be two files other than "
                                 "the model")
    check_output(trace, "trace", [])
    check_output(sidecar, "sidecar", [])

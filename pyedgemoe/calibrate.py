"""Calibration (HOBBIT sec. 3.2 and 3.4): thresholds T1/T2 and cache-policy weights for a model,
from the routing trace of a text, stored in a sidecar next to the model that the Engine reads.

    from pyedgemoe.calibrate import calibrate
    result = calibrate("model.gguf", open("text.txt").read(), budget="25%")
    print(result.t1, result.t2, result.policy_weights)   # also in model.gguf.calibration.json

Four steps, each a function of its own:

1. record_trace: the model runs the text with the expert cache it will run with (the budget), one
   token per ubatch, in sequences of n_ctx tokens, and records every MoE layer's routing (ids and
   gate weights per token). One token per ubatch because the cache behaviour that matters is
   decode's: a prefill ubatch of hundreds of tokens touches most experts of every layer, so its
   evictions barely depend on the policy. While recording, t1 = t2 = 1 (every selection HIGH), so
   the routing is the model's own, not bent by LOW copies or skipped experts, and the cache has
   the HIGH/LOW slot split that `run` gets for the same budget. Where the runtime records its
   predictor's guesses (a "predicted" array in Engine.take_routing_trace), they are kept in the
   trace and their next-layer accuracy is reported; a runtime without a predictor records none.
2. choose_thresholds: the scores s_i of the rule (HOBBIT eq. 2) for every selection, and T1/T2 at
   the quantiles that give a target split of selections into HIGH / LOW / SKIP (HOBBIT's 67% /
   30% / 3% for Mixtral's top-2). For top-k, the top-1 selection scores 0 and is always HIGH: that
   is 1/k of all selections. The default split for top-k (default_split) keeps HOBBIT's treatment
   of the non-top-1 selections: at top-2 its 67/30/3 means that the second selection is HIGH 34%,
   LOW 60% and SKIP 6% of the time, and so is every non-top-1 selection at any k (top-8: 42% /
   52.5% / 5.25% of all selections). Keeping 67% HIGH of all selections instead would make 62% of
   the non-top-1 selections of a top-8 model HIGH, far more conservative than HOBBIT at top-2. T1 is the score below which the other selections complete the HIGH
   share (T1 = 0 when the HIGH target is at most 1/k), T2 the score above which the SKIP share
   lies. The achieved split is then counted with the runtime's own rule (_native.choose_precisions):
   ties between scores make it differ a little from the target.
3. replay: the trace is replayed through the runtime's own cache code (_native.ExpertCache) as
   the runtime drives it: a new sequence restarts the policies' records, the first MoE layer of a
   ubatch advances the token clock by the ubatch's tokens, and each layer places its distinct
   experts (in order of first use) with the highest demand among its tokens. The miss penalty
   (HOBBIT sec. 3.4) counts 1 per HIGH load and LOW bytes / HIGH bytes (= B_low / B_high) per LOW
   load. Deterministic: the same trace and settings give the same numbers.
4. search_policy_weights: HOBBIT's priority weights (lru, lfu, lhu, fld) on a grid over the
   simplex (step 0.1 by default: 286 points, including the single-term vertices, which are the
   lhu and fld policies exactly), keeping the lowest penalty (ties: fewer loads, then grid order);
   the stand-alone lru and lfu policies are replayed for comparison. They keep their records
   across sequences and count frequency since insertion, so they are not grid points and may win.

The sidecar `<model>.calibration.json` (docs/mixed-precision.md) holds t1, t2 and policy_weights,
which the Engine uses where the caller gives none; a model converted with `pyedgemoe convert
--calibration` carries them as `edgemoe.calibration.*` metadata instead (docs/format.md).
Precedence: explicit options > sidecar > embedded metadata > defaults.
"""
from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import dataclass, field

import numpy as np

from pyedgemoe import _native
from pyedgemoe.errors import InvalidOptionError, TextTooShortError

SIDECAR_SUFFIX = ".calibration.json"
TRACE_SUFFIX = ".routing-trace.npz"
SIDECAR_VERSION = 1
METADATA_PREFIX = "edgemoe.calibration."

TOP2_SPLIT = (0.67, 0.30, 0.03)  # HOBBIT sec. 3.2: Mixtral-8x7B with T1 = 0.6, T2 = 0.9
DEFAULT_BUDGET = "25%"
DEFAULT_N_CTX = 512
DEFAULT_MAX_TOKENS = 2048
DEFAULT_GRID_STEP = 0.1
MIN_TOKENS = 64  # fewer tokens give too few selections for quantiles and too short a replay
SINGLE_POLICIES = ("lru", "lfu", "lhu", "fld")
_PRECISION_CODE = {"skip": 0, "low": 1, "high": 2}  # ordered like the runtime's expert_precision
_PRECISION_NAME = ("skip", "low", "high")


def sidecar_path(model_path: str | os.PathLike) -> str:
    return os.fspath(model_path) + SIDECAR_SUFFIX


def trace_path(model_path: str | os.PathLike) -> str:
    return os.fspath(model_path) + TRACE_SUFFIX


# -- the sidecar and the embedded copy ----------------------------------------------------------

def read_sidecar(path: str | os.PathLike) -> dict:
    """A calibration sidecar's contents; InvalidOptionError when it cannot be read or is not version 1."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise InvalidOptionError(f"cannot read the calibration sidecar {path}: {e}") from None
    return _checked(data, f"calibration sidecar {path}")


def _checked(data, what: str) -> dict:
    if not isinstance(data, dict) or data.get("version") != SIDECAR_VERSION:
        raise InvalidOptionError(f"{what} is not version {SIDECAR_VERSION} (run pyedgemoe calibrate again)")
    t1, t2, weights = data.get("t1"), data.get("t2"), data.get("policy_weights")
    if not (isinstance(t1, (int, float)) and isinstance(t2, (int, float)) and 0 <= t1 <= t2 <= 1):
        raise InvalidOptionError(f"{what} has no valid t1 <= t2 in [0, 1] (run pyedgemoe calibrate again)")
    if weights is not None and not (isinstance(weights, list) and len(weights) == 4
                                    and all(isinstance(w, (int, float)) and w >= 0 for w in weights)
                                    and sum(weights) > 0):
        raise InvalidOptionError(f"{what} has invalid policy_weights (four non-negative numbers)")
    return data


def embedded_calibration(model_path: str | os.PathLike, metadata: dict | None = None) -> dict | None:
    """The calibration that `pyedgemoe convert --calibration` embedded in the model, or None.
    metadata: the model's key/values if the caller has them (saves reading the header again)."""
    from pyedgemoe.model_info import read_model_info

    kv = read_model_info(model_path).metadata if metadata is None else metadata
    what = f"calibration embedded in {os.fspath(model_path)}"
    if METADATA_PREFIX + "json" in kv:
        try:
            data = json.loads(str(kv[METADATA_PREFIX + "json"]))
        except ValueError as e:
            raise InvalidOptionError(f"{what} is not valid JSON: {e}") from None
        return _checked(data, what)
    if METADATA_PREFIX + "t1" in kv and METADATA_PREFIX + "t2" in kv:
        data = {"version": SIDECAR_VERSION, "t1": float(kv[METADATA_PREFIX + "t1"]),
                "t2": float(kv[METADATA_PREFIX + "t2"])}
        if METADATA_PREFIX + "policy_weights" in kv:  # an array: model_info gives its length only
            import gguf
            field = gguf.GGUFReader(os.fspath(model_path)).get_field(METADATA_PREFIX + "policy_weights")
            data["policy_weights"] = [float(w) for w in field.contents()]
        return _checked(data, what)
    return None


def load_calibration(model_path: str | os.PathLike, metadata: dict | None = None) -> dict | None:
    """The model's calibration: the sidecar next to it, else the one embedded in its metadata, else
    None. A sidecar or embedded calibration that cannot be read is an error."""
    path = sidecar_path(model_path)
    if os.path.exists(path):
        return read_sidecar(path)
    return embedded_calibration(model_path, metadata)


def write_sidecar(data: dict, path: str | os.PathLike) -> str:
    """Writes data as JSON to path (atomically: a reader never sees half a file)."""
    path = os.fspath(path)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
    return path


def check_calibration(data: dict) -> dict:
    """data, if it is a valid calibration (version 1, 0 <= t1 <= t2 <= 1, four weights); else InvalidOptionError."""
    return _checked(data, "calibration")


def calibration_metadata(data: dict) -> list[tuple[str, object, str]]:
    """The `edgemoe.calibration.*` keys of docs/format.md for a calibration: (key, value, type)
    with type "f32", "f32_array" or "string"."""
    data = _checked(data, "calibration")
    keys = [(METADATA_PREFIX + "t1", float(data["t1"]), "f32"), (METADATA_PREFIX + "t2", float(data["t2"]), "f32")]
    if data.get("policy_weights") is not None:
        keys.append((METADATA_PREFIX + "policy_weights", [float(w) for w in data["policy_weights"]], "f32_array"))
    keys.append((METADATA_PREFIX + "json", json.dumps(data, sort_keys=True), "string"))
    return keys


# -- the target split ---------------------------------------------------------------------------

def parse_split(value) -> tuple[float, float, float]:
    """"0.67,0.30,0.03" or three numbers: the shares of selections HIGH, LOW, SKIP (sum 1)."""
    parts = value.split(",") if isinstance(value, str) else list(value)
    try:
        split = tuple(float(p) for p in parts)
    except (TypeError, ValueError):
        raise InvalidOptionError(f"the target split must be three numbers high,low,skip, got {value!r}") from None
    if len(split) != 3 or any(not 0 <= s <= 1 for s in split) or abs(sum(split) - 1) > 1e-6:
        raise InvalidOptionError(f"the target split must be three shares high,low,skip in [0, 1] that sum "
                                 f"to 1, got {value!r}")
    return split


def default_split(k: int) -> tuple[float, float, float]:
    """The default target split for top-k routing: the top-1 (1/k of the selections) HIGH, and
    every other selection split like the second one of HOBBIT's top-2 split (module doc)."""
    if k < 2:
        return (1.0, 0.0, 0.0)
    high, low, skip = TOP2_SPLIT
    second = (2 * high - 1, 2 * low, 2 * skip)  # at top-2 half the selections are top-1: (0.34, 0.60, 0.06)
    rest = 1 - 1 / k
    return (1 / k + rest * second[0], rest * second[1], rest * second[2])


# -- scores, thresholds, split ------------------------------------------------------------------

def selection_scores(weights: np.ndarray) -> np.ndarray:
    """float64 [n, k]: each selection's score s_i (HOBBIT eq. 2) in the order of `weights`, computed
    with the runtime's arithmetic (native/src/precision-policy.cpp): selections ranked by weight
    (ties: earlier position first), s = the sum, in rank order, of w_j / sum(w) over those ranked
    above, in double precision from the float32 weights; the top-1 scores 0."""
    w32 = np.asarray(weights, dtype=np.float32)
    n, k = w32.shape
    w = w32.astype(np.float64)
    total = np.zeros(n)
    for j in range(k):  # in position order, as the runtime sums
        total = total + w[:, j]
    order = np.argsort(-w32, axis=1, kind="stable")
    rows = np.arange(n)
    safe_total = np.where(total > 0, total, 1.0)
    scores = np.zeros((n, k))
    running = np.zeros(n)
    for r in range(k):
        i = order[:, r]
        scores[rows, i] = running
        running = running + np.where(total > 0, w[rows, i] / safe_total, 0.0)
    return scores


def choose_thresholds(weights: np.ndarray, split=None) -> tuple[float, float]:
    """T1, T2 that split the selections of `weights` [n, k] into the target shares (high, low, skip;
    None: default_split(k)).

    Of n*k selections, the n top-1 ones are always HIGH. Of the other N = n*(k-1), the
    m_high = round(high * n*k) - n with the smallest scores are HIGH too: T1 is the m_high-th smallest
    score (0 when m_high <= 0, i.e. high <= 1/k); the m_skip = round(skip * n*k) with the largest
    scores are skipped: T2 is the (m_skip+1)-th largest (1 when m_skip = 0: nothing is skipped).
    The rule is s <= T1 HIGH, T1 < s <= T2 LOW, s > T2 SKIP; equal scores at a boundary all fall on
    the same side, so count the achieved split with precision_split.
    """
    w = np.asarray(weights, dtype=np.float32)
    if w.ndim != 2 or w.shape[0] == 0:
        raise InvalidOptionError("choosing thresholds needs at least one token's routing weights")
    n, k = w.shape
    high, _low, skip = default_split(k) if split is None else parse_split(split)
    scores = selection_scores(w)
    order = np.argsort(-w, axis=1, kind="stable")
    others = np.sort(np.take_along_axis(scores, order[:, 1:], axis=1).ravel())  # N non-top-1 scores
    n_others = len(others)
    m_high = min(max(int(round(high * n * k)) - n, 0), n_others)
    m_skip = min(max(int(round(skip * n * k)), 0), n_others - m_high)
    t1 = float(others[m_high - 1]) if m_high > 0 else 0.0
    if m_skip == 0:
        t2 = 1.0
    else:
        t2 = float(others[n_others - m_skip - 1]) if n_others - m_skip - 1 >= 0 else 0.0
    return t1, max(t1, t2)


def precision_demands(weights: np.ndarray, t1: float, t2: float, use_low: bool = True,
                      use_skip: bool = True) -> np.ndarray:
    """int8 [n, k]: each selection's demand by the runtime's rule (_native.choose_precisions):
    2 HIGH, 1 LOW, 0 SKIP (the order of the runtime's expert_precision)."""
    w = np.asarray(weights, dtype=np.float32)
    out = np.empty(w.shape, dtype=np.int8)
    for r, row in enumerate(w.tolist()):
        out[r] = [_PRECISION_CODE[p] for p in _native.choose_precisions(row, t1, t2, use_low, use_skip)]
    return out


def split_of(demands: np.ndarray) -> dict:
    """Shares of selections per demand: {"high", "low", "skip"}."""
    total = demands.size
    return {name: float(np.count_nonzero(demands == _PRECISION_CODE[name])) / total if total else 0.0
            for name in ("high", "low", "skip")}


# -- replay through the runtime's cache code ------------------------------------------------------

@dataclass
class ReplayStep:
    """One place() call of the runtime: a layer of a ubatch and its distinct experts' demands."""
    new_sequence: bool
    advance_tokens: int  # > 0 at a ubatch's first MoE layer
    layer: int
    wanted: list  # [(expert, "high"|"low"|"skip")], in order of first use


def replay_steps(trace: dict, demands: np.ndarray) -> list[ReplayStep]:
    """The runtime's place() calls for a trace (records of one (sequence, ubatch, layer) consecutive)
    and each selection's demand: per layer of a ubatch the distinct experts in order of first use,
    each with the highest demand of its tokens (native/src/expert-residency.cpp, place_experts)."""
    layer = np.asarray(trace["layer"])
    ubatch = np.asarray(trace["ubatch"])
    sequence = np.asarray(trace.get("sequence", np.zeros(len(layer), dtype=np.int64)))
    ids = np.asarray(trace["ids"])
    n = len(layer)
    if n == 0:
        return []
    key = np.stack([sequence, ubatch, layer], axis=1)
    starts = np.flatnonzero(np.r_[True, np.any(key[1:] != key[:-1], axis=1)])
    ends = np.r_[starts[1:], n]
    steps: list[ReplayStep] = []
    ids_list, demands_list = ids.tolist(), demands.tolist()
    prev_sequence, prev_ubatch = None, None
    for s, e in zip(starts.tolist(), ends.tolist()):
        seq, ub = int(sequence[s]), int(ubatch[s])
        new_sequence = seq != prev_sequence
        new_ubatch = new_sequence or ub != prev_ubatch
        prev_sequence, prev_ubatch = seq, ub
        best: dict[int, int] = {}
        for t in range(s, e):
            for expert, demand in zip(ids_list[t], demands_list[t]):
                if expert not in best or demand > best[expert]:
                    best[expert] = demand
        steps.append(ReplayStep(new_sequence, e - s if new_ubatch else 0, int(layer[s]),
                                [(expert, _PRECISION_NAME[d]) for expert, d in best.items()]))
    return steps


@dataclass
class CacheSetup:
    """What the runtime's cache is for a budget: slots per tier, layers (FLD's L), LOW cost."""
    high_slots: int
    low_slots: int
    n_layers: int
    low_cost: float  # LOW expert bytes / HIGH expert bytes (= B_low / B_high)
    low_serves_high: bool = True


@dataclass
class ReplayResult:
    policy: str
    weights: tuple | None
    penalty: float
    loads_high: int = 0
    loads_low: int = 0
    hits_high: int = 0
    hits_low: int = 0
    skipped: int = 0
    requests: int = 0
    failures: int = 0  # place() calls the runtime's cache could not serve (the decode would fail)

    @property
    def hit_rate(self) -> float:
        return (self.hits_high + self.hits_low) / self.requests if self.requests else 0.0

    def rank_key(self) -> tuple:
        """Lower is better: a policy under which the runtime fails loses to any that does not."""
        return (self.failures, self.penalty, self.loads_high + self.loads_low)

    def to_dict(self) -> dict:
        return {"policy": self.policy, "weights": list(self.weights) if self.weights else None,
                "penalty": self.penalty, "loads_high": self.loads_high, "loads_low": self.loads_low,
                "hits_high": self.hits_high, "hits_low": self.hits_low, "skipped": self.skipped,
                "requests": self.requests, "hit_rate": self.hit_rate, "failures": self.failures}


def replay(steps: list[ReplayStep], setup: CacheSetup, policy: str = "lru", weights=None) -> ReplayResult:
    """Replays the steps through _native.ExpertCache with `policy` (weights for "hobbit") and
    returns the miss penalty: 1 per HIGH load, setup.low_cost per LOW load (HOBBIT sec. 3.4).

    Where the runtime's cache cannot serve a layer (its tier has no evictable slot left: the
    runtime fails that decode and forgets the cache), the failure is counted and the replay goes on
    from an empty cache at the same token clock, as a retried decode would."""
    w = list(weights) if weights is not None else [0.25] * 4

    def new_cache():
        return _native.ExpertCache(setup.high_slots, setup.low_slots, policy=policy, weights=w,
                                   low_serves_high=setup.low_serves_high, n_layers=setup.n_layers)

    cache = new_cache()
    result = ReplayResult(policy, tuple(w) if policy == "hobbit" else None, 0.0)
    counts = {("high", True): 0, ("low", True): 0, ("high", False): 0, ("low", False): 0, ("skip", False): 0}
    tokens_in_sequence = 0
    for step in steps:
        if step.new_sequence:
            cache.start_sequence()
            tokens_in_sequence = 0
        if step.advance_tokens:
            cache.advance_tokens(step.advance_tokens)
            tokens_in_sequence += step.advance_tokens
        try:
            placed = cache.place(step.layer, step.wanted)
        except RuntimeError:
            result.failures += 1
            cache = new_cache()
            cache.advance_tokens(tokens_in_sequence)
            placed = cache.place(step.layer, step.wanted)
        for _expert, precision, _slot, load in placed:
            counts[precision, load] += 1
    result.loads_high, result.loads_low = counts["high", True], counts["low", True]
    result.hits_high, result.hits_low = counts["high", False], counts["low", False]
    result.skipped = counts["skip", False]
    result.requests = sum(counts.values())
    result.penalty = result.loads_high + setup.low_cost * result.loads_low
    return result


def weight_grid(step: float = DEFAULT_GRID_STEP) -> list[tuple[float, float, float, float]]:
    """Every (lru, lfu, lhu, fld) with components multiples of step and sum 1, in lexicographic order."""
    n = round(1 / step)
    if n < 1 or abs(n * step - 1) > 1e-9:
        raise InvalidOptionError(f"the grid step must divide 1 (0.5, 0.25, 0.2, 0.1, 0.05, ...), got {step!r}")
    return [(a / n, b / n, c / n, (n - a - b - c) / n)
            for a, b, c in itertools.product(range(n + 1), repeat=3) if a + b + c <= n]


def search_policy_weights(steps: list[ReplayStep], setup: CacheSetup,
                          step: float = DEFAULT_GRID_STEP) -> tuple[ReplayResult, dict[str, ReplayResult]]:
    """The hobbit weights of the grid with the lowest penalty (ties: fewer loads, then grid order;
    fewer failures first), and the replay of every single policy (lru, lfu, lhu, fld) to compare."""
    best = None
    for weights in weight_grid(step):
        r = replay(steps, setup, "hobbit", weights)
        if best is None or r.rank_key() < best.rank_key():
            best = r
    singles = {policy: replay(steps, setup, policy) for policy in SINGLE_POLICIES}
    return best, singles


# -- recording ------------------------------------------------------------------------------------

def record_trace(engine, tokens: list[int], n_ctx: int) -> dict:
    """The routing of `tokens` under engine (which needs an expert cache) as decode sees it:
    consecutive sequences of n_ctx tokens, each on a fresh context, one token per llama_decode
    with its logits (llama.cpp computes the last layer only for tokens whose logits are wanted, so
    a prefill would skip the last MoE layer for all but its last token). Returns the arrays of
    Engine.take_routing_trace plus "sequence" [n]."""
    parts = []
    engine.record_routing(True)
    try:
        engine.take_routing_trace()  # whatever was recorded before
        for i, start in enumerate(range(0, len(tokens), n_ctx)):
            # a fresh sequence, as a new prompt starts one: the cache's records restart
            engine.logits(tokens[start:start + n_ctx], one_token_per_step=True)
            part = engine.take_routing_trace()
            part["sequence"] = np.full(len(part["layer"]), i, dtype=np.int32)
            parts.append(part)
    finally:
        engine.record_routing(False)
    keys = parts[0].keys()
    return {key: np.concatenate([p[key] for p in parts]) for key in keys}


def save_trace(trace: dict, path: str | os.PathLike) -> str:
    """Writes the trace's arrays to `path` (npz; exactly that name)."""
    path = os.fspath(path)
    with open(path, "wb") as f:
        np.savez_compressed(f, **{k: np.asarray(v) for k, v in trace.items()})
    return path


def load_trace(path: str | os.PathLike) -> dict:
    with np.load(os.fspath(path)) as data:
        return {k: data[k] for k in data.files}


def expert_usage(trace: dict, n_expert: int) -> dict[str, list[int]]:
    """Per MoE layer, how many selections each expert got."""
    layer, ids = np.asarray(trace["layer"]), np.asarray(trace["ids"])
    return {str(int(l)): np.bincount(ids[layer == l].ravel(), minlength=n_expert).tolist()
            for l in np.unique(layer)}


def prediction_accuracy(trace: dict) -> dict | None:
    """Of the predictor's guesses in the trace ("predicted" [n, k]: the experts predicted one MoE
    layer earlier for each record's token and layer, best first; -1 where none was made, as for the
    first MoE layer): how often the predicted top-1 is the router's top-1 (HOBBIT Fig. 7b), and the
    share of the router's selections that were predicted (recall), counted as the runtime's
    prediction statistics count them. None when the trace has no predictions."""
    if "predicted" not in trace:
        return None
    predicted, ids = np.asarray(trace["predicted"]), np.asarray(trace["ids"])
    if predicted.shape != ids.shape:
        return None
    made = predicted[:, 0] >= 0
    n_made = int(made.sum())
    if n_made == 0:
        return {"n_predicted": 0, "top1_accuracy": None, "recall": None}
    guessed, actual = predicted[made], ids[made]
    overlap = sum(int(np.isin(g, a).sum()) for g, a in zip(guessed, actual))
    return {"n_predicted": n_made, "top1_accuracy": float(np.mean(guessed[:, 0] == actual[:, 0])),
            "recall": overlap / actual.size}


# -- the whole calibration -------------------------------------------------------------------------

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


def calibrate(model_path: str | os.PathLike, text: str, *, budget: str | int = DEFAULT_BUDGET,
              split=None, n_ctx: int = DEFAULT_N_CTX, max_tokens: int | None = DEFAULT_MAX_TOKENS,
              trace: str | os.PathLike | None = None, sidecar: str | os.PathLike | None = None,
              grid_step: float = DEFAULT_GRID_STEP, text_name: str | None = None, write: bool = True,
              **engine_options) -> CalibrationResult:
    """Calibrates the model on text under an expert cache of `budget` and writes the trace (default
    `<model>.routing-trace.npz`) and the sidecar (default `<model>.calibration.json`).

    split: target shares of selections (high, low, skip; None: default_split of the model's top-k). n_ctx: tokens per sequence. max_tokens:
    use at most this many tokens of the text (None: all). engine_options: further Engine arguments
    (n_threads, io, io_threads, low_cache, low_hit, low_from, verbose). Raises InvalidOptionError
    for a dense model, a bad split or budget, TextTooShortError for fewer than MIN_TOKENS tokens.
    """
    from pyedgemoe.engine import Engine
    from pyedgemoe.model_info import read_model_info

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
    if budget is None or (isinstance(budget, str) and budget.strip().lower() == "auto"):
        raise InvalidOptionError("calibration needs an expert cache budget (a size or a share, e.g. 25%)")
    weight_grid(grid_step)  # a bad step fails before the model runs

    notes: list[str] = []
    start = time.perf_counter()
    # t1 = t2 = 1: every selection HIGH, so the routing recorded is the model's own (module doc);
    # an empty cache at the start, as in the replay
    with Engine(model_path, n_ctx=n_ctx, n_batch=1, expert_cache=budget, t1=1.0, t2=1.0, fill_cache=False,
                **engine_options) as eng:
        tokens = eng.tokenize(text, add_bos=True, special=False)
        if max_tokens is not None:
            tokens = tokens[:max_tokens]
        if len(tokens) < MIN_TOKENS:
            raise TextTooShortError(f"calibration needs at least {MIN_TOKENS} tokens of text, "
                                    f"the text has only {len(tokens)}")
        residency = dict(eng.expert_residency)
        routing = record_trace(eng, tokens, n_ctx)
        low_source = residency.get("low_source") or None
    record_seconds = time.perf_counter() - start

    k = residency["n_expert_used"]
    split = default_split(k) if split is None else split
    weights = np.asarray(routing["weights"], dtype=np.float32)
    t1, t2 = choose_thresholds(weights, split)
    achieved = split_of(precision_demands(weights, t1, t2))
    if not residency["mixed_precision"]:
        notes.append("the model has no LOW expert copies: the thresholds take effect with --low-from "
                     "(or a multi-precision GGUF); the replay loads everything in HIGH")
    if k == 1:
        notes.append("top-1 routing: every selection is HIGH, the thresholds have no effect")
    groups = {(info.high_expert_bytes_per_layer.get(l), info.low_expert_bytes_per_layer.get(l))
              for l in info.expert_bytes_per_layer}
    if len(groups) > 1:
        notes.append(f"the MoE layers have {len(groups)} expert shapes (slot pool groups); the replay "
                     "approximates them with one pool of all slots")

    demands = precision_demands(weights, t1, t2, use_low=residency["mixed_precision"], use_skip=residency["skip"])
    steps = replay_steps(routing, demands)
    low_cost = residency["low_expert_bytes"] / residency["expert_bytes"] if residency["mixed_precision"] else 0.0
    setup = CacheSetup(high_slots=residency["high_slots"], low_slots=residency["low_slots"],
                       n_layers=residency["n_layers"], low_cost=low_cost,
                       low_serves_high=engine_options.get("low_hit", "accept") == "accept")
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
                     f"run with --cache-policy {winner.policy}")

    n_sequences = int(routing["sequence"].max()) + 1 if len(routing["sequence"]) else 0
    data = {
        "version": SIDECAR_VERSION,
        "t1": t1,
        "t2": t2,
        "policy_weights": [float(w) for w in best.weights],
        "best_policy": winner.policy,
        "target_split": dict(zip(("high", "low", "skip"), split)),
        "achieved_split": achieved,
        "n_experts_used": k,
        "penalties": {"hobbit": best.to_dict(), **{p: r.to_dict() for p, r in singles.items()}},
        "grid_step": grid_step,
        "budget": str(budget),
        "budget_bytes": residency["budget_bytes"],
        "high_slots": residency["high_slots"],
        "low_slots": residency["low_slots"],
        "low_cost": low_cost,
        "low_hit": engine_options.get("low_hit", "accept"),
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
    result = CalibrationResult(data, notes=notes)
    if write:
        result.trace = save_trace(routing, trace if trace is not None else trace_path(model_path))
        data["trace"] = os.path.basename(result.trace)
        result.sidecar = write_sidecar(data, sidecar if sidecar is not None else sidecar_path(model_path))
    return result

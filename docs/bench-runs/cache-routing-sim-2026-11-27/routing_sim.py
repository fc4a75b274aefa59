"""Cache-aware routing rules simulated offline on the trained models (2026-11-27; docs/systems.md).

A torch re-implementation of the Qwen3-MoE forward from the GGUF's HIGH copies (dequantized, fp32),
decoding one token per step, with a per-layer LRU expert cache of `cap` slots; each rule rewrites a
layer's top-k given what is cached. Checked against the native runtime: the first 8 steps' logits
within 0.04 (llama.cpp quantizes activations for Q8_0), HIGH-only greedy tokens agree on 99.5-99.8 %
of the agreement steps. Run from the repository root:

    .venv/bin/python docs/bench-runs/cache-routing-sim-2026-11-27/routing_sim.py models/demo.gguf 4 none spread:0.1 similar:0.1

Rules: none, spread:λ (the shipped rule), oracle:τ (swap when the true change of the residual,
|w_e (f_c - f_e)| / |x|, is at most τ: needs the missed expert, an upper bound), similar:τ (the same
with the mean of that change over calibration tokens, M[l][e][c]), qm:q (similar with a per-layer
τ, the q-quantile of w_e min_c M[l][e][c] over the calibration split's selections), rsim:τ (the mean
router-logit gap |log p_e - log p_c| instead of M), qsim:q (rsim with quantile τs), wsim:τ (M from
Gaussian inputs, no data). One JSON line per rule: agreement (teacher-forced top-1 against HIGH
only's greedy tokens, 16 held-out prompts x 128), decode-mode perplexity over 4 x 256 held-out
tokens, misses per expert use.
"""
import json, math, sys, time
from collections import OrderedDict
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

torch.set_num_threads(2)
REPO = Path(__file__).resolve().parents[3]

class Model:
    def __init__(self, path):
        r = gguf.GGUFReader(path)
        kv = {f.name: f for f in r.fields.values()}
        def val(k):
            f = kv[k]; return f.parts[f.data[0]].tolist()[0] if len(f.data) == 1 else None
        arch = 'qwen3moe'
        self.n_layer = val(f'{arch}.block_count'); self.n_head = val(f'{arch}.attention.head_count')
        self.n_kv = val(f'{arch}.attention.head_count_kv'); self.k_used = val(f'{arch}.expert_used_count')
        self.n_expert = val(f'{arch}.expert_count'); self.eps = val(f'{arch}.attention.layer_norm_rms_epsilon')
        self.theta = val(f'{arch}.rope.freq_base')
        W = {}
        for t in r.tensors:
            if t.name.endswith('.lowbit'): continue
            a = dequantize(t.data, t.tensor_type).astype(np.float32)
            W[t.name] = torch.from_numpy(np.ascontiguousarray(a))
        self.W = W
        self.head_dim = W['blk.0.attn_k_norm.weight'].shape[0]

    def rms(self, x, w):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps) * w

    def rope(self, x, pos):  # x [heads, hd], neox
        hd = x.shape[-1]; half = hd // 2
        inv = self.theta ** (-torch.arange(0, half, dtype=torch.float64) * 2 / hd)
        ang = (pos * inv).float(); c, s = torch.cos(ang), torch.sin(ang)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    def expert(self, l, e, x):
        W = self.W
        g = W[f'blk.{l}.ffn_gate_exps.weight'][e] @ x
        u = W[f'blk.{l}.ffn_up_exps.weight'][e] @ x
        return W[f'blk.{l}.ffn_down_exps.weight'][e] @ (torch.nn.functional.silu(g) * u)

    def step(self, tok, pos, kvc, route):
        """One decode token; route(l, probs, x) -> list of (expert, weight)."""
        W = self.W; x = W['token_embd.weight'][tok].clone()
        hd = self.head_dim
        for l in range(self.n_layer):
            h = self.rms(x, W[f'blk.{l}.attn_norm.weight'])
            q = (W[f'blk.{l}.attn_q.weight'] @ h).view(self.n_head, hd)
            k = (W[f'blk.{l}.attn_k.weight'] @ h).view(self.n_kv, hd)
            v = (W[f'blk.{l}.attn_v.weight'] @ h).view(self.n_kv, hd)
            q = self.rope(self.rms(q, W[f'blk.{l}.attn_q_norm.weight']), pos)
            k = self.rope(self.rms(k, W[f'blk.{l}.attn_k_norm.weight']), pos)
            kvc[l][0].append(k); kvc[l][1].append(v)
            K = torch.stack(kvc[l][0], 1); V = torch.stack(kvc[l][1], 1)  # [kv, T, hd]
            rep = self.n_head // self.n_kv
            K = K.repeat_interleave(rep, 0); V = V.repeat_interleave(rep, 0)
            att = torch.softmax((K @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(hd), -1)  # [h, T]
            o = (att.unsqueeze(1) @ V).squeeze(1).reshape(-1)
            x = x + W[f'blk.{l}.attn_output.weight'] @ o
            h = self.rms(x, W[f'blk.{l}.ffn_norm.weight'])
            probs = torch.softmax(W[f'blk.{l}.ffn_gate_inp.weight'] @ h, -1)
            y = torch.zeros_like(x)
            for e, w in route(l, probs, h, x):
                y += w * self.expert(l, e, h)
            x = x + y
        x = self.rms(x, W['output_norm.weight'])
        return W['output.weight'] @ x


class LRU:
    def __init__(self, n_layer, cap):
        self.c = [OrderedDict() for _ in range(n_layer)]; self.cap = cap; self.misses = 0; self.uses = 0
    def has(self, l, e): return e in self.c[l]
    def use(self, l, e):
        self.uses += 1
        d = self.c[l]
        if e in d: d.move_to_end(e)
        else:
            self.misses += 1; d[e] = 1
            if len(d) > self.cap: d.popitem(last=False)

class Decay:
    """The runtime's decay policy (native/src/cache-policy-decay.cpp) over one pool of n_layer * cap slots:
    the victim is the expert expected back last, its decayed use rate's expected absence plus the layers
    until its layer runs again, weighed as 16 tokens a whole token; never one the current layer chose."""
    HALF_LIFE, LAYER_TOKENS = 16.0, 16.0

    def __init__(self, n_layer, cap):
        self.n_layer, self.slots = n_layer, n_layer * cap
        self.level = {}  # (l, e) -> log2 of the decayed use count at token 0: constant while unused
        self.cached, self.token, self.misses, self.uses = set(), 0, 0, 0
        self.current = (0, set())

    def has(self, l, e):
        return (l, e) in self.cached

    def use(self, l, e):
        self.uses += 1
        if l == 0 and self.current[0] != 0:
            self.token += 1
        if self.current[0] != l:
            self.current = (l, set())
        self.current[1].add(e)
        age = self.token / self.HALF_LIFE
        self.level[l, e] = math.log2(2 ** (self.level.get((l, e), -math.inf) - age) + 1) + age
        if (l, e) in self.cached:
            return
        self.misses += 1
        if len(self.cached) >= self.slots:
            per_token = 1 - 2 ** (-1 / self.HALF_LIFE)
            age = self.token / self.HALF_LIFE

            def away(key):
                rate = 2 ** (self.level[key] - age) * per_token
                layers = (key[0] - l - 1) % self.n_layer + 1  # the layer just run: a whole token
                return 1 / rate + self.LAYER_TOKENS * layers / self.n_layer
            self.cached.remove(max((k for k in self.cached if not (k[0] == l and k[1] in self.current[1])), key=away))
        self.cached.add((l, e))


def topk(m, probs):
    w, e = torch.topk(probs, m.k_used); return e.tolist(), (w / w.sum()).tolist()

def spread(lam):
    def rule(m, cache, l, probs, h, x):
        ids, _ = topk(m, probs)
        lp = torch.log(probs.double()); bonus = lam * (lp.max() - lp.min()).item()
        score = [lp[e].item() + (bonus if cache.has(l, e) else 0) for e in range(m.n_expert)]
        order = sorted(range(m.n_expert), key=lambda e: (-score[e], e not in ids))
        new = order[:m.k_used]
        p = probs[new]; return new, (p / p.sum()).tolist()
    return rule

def oracle(tau):
    """swap an uncached selection for the cached expert whose substitution moves the residual least, if <= tau"""
    def rule(m, cache, l, probs, h, x):
        ids, ws = topk(m, probs)
        out = list(zip(ids, ws)); xn = x.norm().item()
        for i, (e, w) in enumerate(out):
            if cache.has(l, e): continue
            fe = m.expert(l, e, h); best = None
            chosen = {a for a, _ in out}
            for c in range(m.n_expert):
                if c in chosen or not cache.has(l, c): continue
                d = (w * (m.expert(l, c, h) - fe)).norm().item() / xn if xn > 0 else math.inf
                if best is None or d < best[0]: best = (d, c)
            if best and best[0] <= tau: out[i] = (best[1], w)
        return [a for a, _ in out], [b for _, b in out]
    return rule

def run(m, R, rule, cap, split='heldout', policy=LRU):
    """decode-mode perplexity over R['ppl'], then agreement over the prompts, one cache throughout"""
    cache = policy(m.n_layer, cap); same = total = 0; nll = []

    def decode(toks, scored):
        kvc = [([], []) for _ in range(m.n_layer)]
        for i, t in enumerate(toks):
            def route(l, probs, h, x):
                ids, ws = rule(m, cache, l, probs, h, x)
                for e in ids: cache.use(l, e)
                return list(zip(ids, ws))
            scored(i, m.step(t, i, kvc, route))

    for chunk in R['ppl']:
        decode(chunk[:-1], lambda i, lg: nll.append(-torch.log_softmax(lg, -1)[chunk[i + 1]].item()) if i >= len(chunk) // 2 else None)
    for p, ref in zip(R[split]['prompts'], R[split]['refs']):
        def scored(i, lg, p=p, ref=ref):
            nonlocal same, total
            if i >= len(p) - 1:
                same += int(lg.argmax().item() == ref[i - len(p) + 1]); total += 1
        decode(p + ref[:-1], scored)
    return dict(agreement=same / total, ppl=math.exp(sum(nll) / len(nll)), miss_rate=cache.misses / cache.uses,
                misses=cache.misses)


def walk(m, R, observe, split='train', max_tokens=3000):
    """HIGH only over the calibration split's prompts and continuations; observe(l, probs, h, x, ids, ws)
    at every MoE layer of the first max_tokens steps"""
    n = 0
    for p, ref in zip(R[split]['prompts'], R[split]['refs']):
        kvc = [([], []) for _ in range(m.n_layer)]
        for i, t in enumerate(p + ref[:-1]):
            def route(l, probs, h, x):
                ids, ws = topk(m, probs)
                observe(l, probs, h, x, ids, ws)
                return list(zip(ids, ws))
            m.step(t, i, kvc, route)
            n += 1
            if n >= max_tokens:
                return


def mean_over_choices(m, R, table):
    """[L][E][E]: row e the mean of table(l, probs, h, x)[e] (an [E][E] matrix, or None: no sample) over
    the calibration tokens whose router chose e"""
    S = torch.zeros(m.n_layer, m.n_expert, m.n_expert, dtype=torch.float64)
    N = torch.zeros(m.n_layer, m.n_expert, dtype=torch.float64)

    def observe(l, probs, h, x, ids, ws):
        D = table(l, probs, h, x)
        for e in ids if D is not None else ():
            S[l, e] += D[e].double()
            N[l, e] += 1
    walk(m, R, observe)
    return (S / N.clamp(min=1).unsqueeze(-1)).float()


def calibrate_pairs(m, R, norm='x'):
    """M[l][e][c]: the mean of ||f_c(h) - f_e(h)|| / ||x|| (or ||h||, or 1) over the tokens whose router chose e"""
    def table(l, probs, h, x):
        xn = {'x': x.norm(), 'h': h.norm(), 'none': torch.tensor(1.0)}[norm]
        if xn == 0:  # the BOS token's residual is 0 in layer 0
            return None
        F = torch.stack([m.expert(l, c, h) for c in range(m.n_expert)])  # [E, H]
        return (F.unsqueeze(1) - F.unsqueeze(0)).norm(dim=2) / xn
    return mean_over_choices(m, R, table)


def router_pairs(m, R):
    """K[l][e][c]: the mean of |log p_e - log p_c| over the tokens whose router chose e"""
    def table(l, probs, h, x):
        lp = torch.log(probs.double())
        return (lp.unsqueeze(1) - lp.unsqueeze(0)).abs()
    return mean_over_choices(m, R, table)


def quantile_taus(m, R, K, q, max_tokens=1500):
    """per layer: the q-quantile of w_e min_c K[l][e][c] (c not chosen) over the calibration's choices"""
    costs = [[] for _ in range(m.n_layer)]

    def observe(l, probs, h, x, ids, ws):
        for e, w in zip(ids, ws):
            costs[l].append(w * min(K[l, e, c].item() for c in range(m.n_expert) if c not in ids))
    walk(m, R, observe, max_tokens=max_tokens)
    return [torch.tensor(c).quantile(q).item() for c in costs]


def similar(tau, M):
    def rule(m, cache, l, probs, h, x):
        ids, ws = topk(m, probs)
        out = list(zip(ids, ws))
        for i, (e, w) in enumerate(out):
            if cache.has(l, e): continue
            chosen = {a for a, _ in out}
            cands = [(w * M[l, e, c].item(), c) for c in range(m.n_expert) if c not in chosen and cache.has(l, c)]
            if cands:
                d, c = min(cands)
                if d <= tau: out[i] = (c, w)
        return [a for a, _ in out], [b for _, b in out]
    return rule

def weight_pairs(m, n=256, seed=0):
    """data-free: h = ffn_norm ⊙ z, z ~ N(0, 1); M[l][e][c] = mean ||f_c(h) - f_e(h)|| / mean ||f(h)|| over experts"""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(m.n_layer, m.n_expert, m.n_expert)
    for l in range(m.n_layer):
        Z = torch.randn(n, m.W[f'blk.{l}.ffn_norm.weight'].shape[0], generator=g) * m.W[f'blk.{l}.ffn_norm.weight']
        F = torch.stack([torch.stack([m.expert(l, e, z) for z in Z]) for e in range(m.n_expert)])  # [E, n, H]
        D = torch.stack([(F - F[e]).norm(dim=-1).mean(-1) for e in range(m.n_expert)])
        out[l] = D / F.norm(dim=-1).mean()
    return out


def layer_similar(taus, M):
    def rule(m, cache, l, probs, h, x):
        return similar(taus[l], M)(m, cache, l, probs, h, x)
    return rule


def references(model):
    """HIGH-only greedy continuations of 16 held-out and 16 training-split prompts (the native runtime), and 16
    chunks of 256 held-out tokens for perplexity (the second half of each scored, as llama.cpp's perplexity)"""
    out = REPO / 'build' / 'routing-sim' / (Path(model).stem + '-refs16.json')
    if out.exists(): return json.loads(out.read_text())
    sys.path.insert(0, str(REPO / 'scripts'))
    from fidelity_report import CONTINUATION, N_PROMPTS, PROMPT_TOKENS, SETTINGS, corpus_texts
    from pyedgemoe import Engine
    heldout, train = corpus_texts(); res = {}
    with Engine(model, **SETTINGS) as eng:
        for split, text in (('heldout', heldout), ('train', train)):
            ids = eng.tokenize(text, add_bos=False); step = len(ids) // N_PROMPTS
            prompts = [ids[i * step:i * step + PROMPT_TOKENS] for i in range(N_PROMPTS)]
            res[split] = dict(prompts=prompts, refs=[eng.time_generation(p, CONTINUATION)['tokens'] for p in prompts])
        ids = eng.tokenize(heldout, add_bos=False)
        res['ppl'] = [[eng.token_bos()] + ids[i * 256:(i + 1) * 256 - 1] for i in range(16)]
    out.parent.mkdir(parents=True, exist_ok=True); out.write_text(json.dumps(res))
    return res


if __name__ == "__main__":
    policy = Decay if '--decay' in sys.argv else LRU
    if policy is Decay:
        sys.argv.remove('--decay')
    chunks = 4  # perplexity chunks, 127 tokens scored each: 4 in the first tables, 16 with --ppl-16
    if '--ppl-16' in sys.argv:
        chunks = 16
        sys.argv.remove('--ppl-16')
    model, cap = sys.argv[1], int(sys.argv[2])
    m = Model(model)
    R = references(model)
    R = {**R, 'ppl': R['ppl'][:chunks]}
    work = REPO / 'build' / 'routing-sim'

    def stat(name, make):  # computed once a model (minutes), kept in build/routing-sim
        path = work / f'{Path(model).stem}-{name}.pt'
        if not path.exists():
            torch.save(make(), path)
        return torch.load(path)
    M = lambda: stat('pairs', lambda: calibrate_pairs(m, R))  # noqa: E731
    Mh = lambda: stat('pairs-h', lambda: calibrate_pairs(m, R, norm='h'))  # noqa: E731
    Mr = lambda: stat('pairs-raw', lambda: calibrate_pairs(m, R, norm='none'))  # noqa: E731
    K = lambda: stat('router', lambda: router_pairs(m, R))  # noqa: E731
    rules = {'none': lambda a: spread(0.0), 'spread': lambda a: spread(a), 'oracle': lambda a: oracle(a),
             'similar': lambda a: similar(a, M()), 'rsim': lambda a: similar(a, K()),
             'wsim': lambda a: similar(a, weight_pairs(m)),
             'qm': lambda a: layer_similar(quantile_taus(m, R, M(), a), M()),
             'qmh': lambda a: layer_similar(quantile_taus(m, R, Mh(), a), Mh()),
             'qmr': lambda a: layer_similar(quantile_taus(m, R, Mr(), a), Mr()),
             'qsim': lambda a: layer_similar(quantile_taus(m, R, K(), a), K())}
    for spec in sys.argv[3:]:
        name, _, arg = spec.partition(':')
        rule = rules[name](float(arg) if arg else None)
        t0 = time.time()
        r = run(m, R, rule, cap, policy=policy)
        r.update(model=Path(model).name, cap=cap, cache=policy.__name__.lower(), ppl_tokens=chunks * 127, rule=spec,
                 s=round(time.time() - t0))
        print(json.dumps(r), flush=True)

"""Token sampling: validated parameters (``SamplingParams``) and a stateful ``Sampler`` (RNG, recent tokens).

The chain and every definition follow llama.cpp (``common/sampling.cpp`` builds the chain in the order of
``common_params_sampling::samplers``; each step is ``src/llama-sampling.cpp``):

1. non-finite logits (NaN, +-inf) are masked (never sampled); none finite -> ``ColiError("non-finite logits")``
2. penalties over the last ``repeat_last_n`` accepted tokens (``llama_sampler_penalties_apply``): a token seen
   ``c`` times has its logit divided by ``repeat_penalty`` when positive, multiplied when <= 0, then lowered by
   ``c * frequency_penalty + presence_penalty``
3. ``top_k`` highest logits (0 = all)  4. ``top_p`` nucleus: the fewest tokens whose softmax mass reaches
   ``top_p``  5. ``min_p``: tokens whose probability is at least ``min_p`` times the largest one's
6. temperature: ``temp == 0`` picks the largest (greedy, after the penalties); else softmax(logits / temp)
   and one draw from the seeded RNG (``llama_sampler_dist``).

Like llama.cpp, top-k/top-p/min-p see the logits before the temperature, and at least one token always
survives every filter. The prompt's tokens are accepted into the penalty window before the first sample, as
llama-cli and llama-server do. docs/contracts.md describes the engine API that uses this module.
"""
from __future__ import annotations

import math
import operator
import secrets
from collections import deque
from dataclasses import dataclass, fields, replace

import numpy as np

from coli.base.errors import ColiError

_FMAX = float(np.finfo(np.float64).max)

# API argument -> CLI flag (one error names both: "temp (--temp): ...")
_FLAGS = dict(temp="--temp", top_k="--top-k", top_p="--top-p", min_p="--min-p", repeat_penalty="--repeat-penalty",
              repeat_last_n="--repeat-last-n", presence_penalty="--presence-penalty",
              frequency_penalty="--frequency-penalty", seed="--seed")


def top_ids(v: np.ndarray, k: int) -> np.ndarray:
    """Ids int64 of the ``k`` largest finite values of ``v`` (f64 [n]), largest first, equal values by lower id:
    ``np.argsort(-v, kind="stable")`` with the non-finite dropped, its first ``k`` (every finite one for ``k <= 0``
    or more than there are).

    Why not one ``argpartition`` of the row: on a 50k vocabulary it costs ~0.8 ms a token. The ``k``-th largest
    of a strided sample of ``v`` is a threshold that at least ``k`` values reach (they are in the sample), so
    the values at or above it hold the top ``k``: a partition of n / 16 values, one compare, and a sort of the
    few (~16 k) candidates."""
    n = v.size
    if 0 < k and 8 * k < n:
        t = np.partition(v[:: min(16, n // (4 * k))], -k)[-k]
        c = np.flatnonzero(v >= t) if math.isfinite(t) else None
        if c is not None:
            c = c[v[c] < np.inf]  # +inf reaches any threshold but is not finite
        if c is None or c.size < k:  # a NaN in the sample sorts above every number: fewer than k may reach t
            c = np.flatnonzero(np.isfinite(v))
    else:
        c = np.flatnonzero(np.isfinite(v))
    c = c[np.argsort(-v[c], kind="stable")]
    return c[:k] if k > 0 else c


def _where(name: str) -> str:
    return f"{name} ({_FLAGS[name]})" if name in _FLAGS else name


def _as_float(name, v, lo=None, hi=None, lo_open=False, what=""):
    if isinstance(v, (bool, np.bool_)) or isinstance(v, (str, bytes)):
        raise ColiError(f"{_where(name)}: {v!r} is not a number{what}")
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ColiError(f"{_where(name)}: {v!r} is not a number{what}") from None
    if not math.isfinite(f):
        raise ColiError(f"{_where(name)}: {v} is not finite{what}")
    if lo is not None and (f < lo or (lo_open and f == lo)):
        raise ColiError(f"{_where(name)}: {v}{what}")
    if hi is not None and f > hi:
        raise ColiError(f"{_where(name)}: {v}{what}")
    return f


def _as_int(name, v, lo=None, what=""):
    if isinstance(v, (bool, np.bool_)):
        raise ColiError(f"{_where(name)}: {v!r} is not an integer{what}")
    try:
        i = operator.index(v)
    except TypeError:
        # 40.0 is accepted as 40 (JSON clients send floats); 40.5 is not
        if isinstance(v, (float, np.floating)) and math.isfinite(v) and float(v).is_integer():
            i = int(v)
        else:
            raise ColiError(f"{_where(name)}: {v!r} is not an integer{what}") from None
    if lo is not None and i < lo:
        raise ColiError(f"{_where(name)}: {v}{what}")
    return int(i)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings, validated by ``validated()`` (every field finite and in range).

    ``temp`` >= 0 (0 = greedy); ``top_k`` >= 0 (0 = every token); ``top_p`` in [0, 1] (1 = off; 0 keeps the
    most likely token, as llama.cpp's top-p keeps at least one); ``min_p`` in
    [0, 1] (0 = off); ``repeat_penalty`` > 0 (1 = off); ``repeat_last_n`` >= -1 (tokens in the penalty window;
    0 = off, -1 = the context size, as llama.cpp); ``presence_penalty``, ``frequency_penalty`` finite (0 = off;
    OpenAI's range is [-2, 2], llama.cpp does not bound them); ``seed``: None or -1 = a random seed (llama.cpp's
    ``LLAMA_DEFAULT_SEED``), else an integer >= 0. ``None`` for any other field means its default (OpenAI
    clients send ``null`` for unset fields).
    """

    temp: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def validated(self) -> "SamplingParams":
        """A copy with every field checked and converted (floats, ints); ``ColiError`` naming the argument
        and its CLI flag otherwise. The seed stays None/-1 here (``Sampler`` draws the random one)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for f in fields(self):
            if f.name != "seed" and d[f.name] is None:
                d[f.name] = f.default
        out = dict(
            temp=_as_float("temp", d["temp"], lo=0.0, what=" (0 for greedy, or above)"),
            top_k=_as_int("top_k", d["top_k"], lo=0, what=" (0 for all, or above)"),
            top_p=_as_float("top_p", d["top_p"], lo=0.0, hi=1.0, what=" (in [0, 1]; 1 = off)"),
            min_p=_as_float("min_p", d["min_p"], lo=0.0, hi=1.0, what=" (in [0, 1]; 0 = off)"),
            repeat_penalty=_as_float("repeat_penalty", d["repeat_penalty"], lo=0.0, lo_open=True,
                                     what=" (above 0; 1 = off)"),
            repeat_last_n=_as_int("repeat_last_n", d["repeat_last_n"], lo=-1,
                                  what=" (tokens: 0 = off, -1 = the context size)"),
            presence_penalty=_as_float("presence_penalty", d["presence_penalty"], what=" (0 = off)"),
            frequency_penalty=_as_float("frequency_penalty", d["frequency_penalty"], what=" (0 = off)"),
            seed=None if d["seed"] is None else _as_int("seed", d["seed"], lo=-1, what=" (-1 for random, or >= 0)"),
        )
        return SamplingParams(**out)

    @property
    def greedy(self) -> bool:
        return self.temp == 0.0

    @property
    def penalizes(self) -> bool:
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                                            or self.frequency_penalty != 0.0)


class Sampler:
    """Picks the next token from one row of logits (f32/f64 ``[n_vocab]``) and keeps the state between tokens:
    the seeded RNG and the penalty window of recent tokens.

    ``Sampler(params, ctx=4096)`` or ``Sampler(temp=0.8, top_k=40, seed=1)``; ``rng`` replaces the seeded
    generator (a ``numpy.random.Generator``). ``seed`` is the seed actually used (drawn from the OS when
    None or -1; print it to let a run be repeated). ``n_vocab`` restricts sampling to the first ``n_vocab``
    logits (rows of the output matrix beyond the token table are never sampled).

    ``logit_bias``, ``constraint`` and ``top_logprobs`` (per-token logprobs into ``self.logprobs``): see
    :meth:`sample`. Counters: ``masked_steps`` (rows that had a non-finite logit), ``masked_logits`` (how many in
    all).
    Raises ``ColiError`` for bad settings and for a row with no finite logit.
    """

    def __init__(self, params: SamplingParams | None = None, *, ctx: int | None = None, n_vocab: int | None = None,
                 rng: np.random.Generator | None = None, logit_bias: dict | None = None, constraint=None,
                 top_logprobs: int | None = None, **kw):
        if params is None:
            params = SamplingParams(**kw)
        elif kw:
            params = replace(params, **kw)
        self.params = p = params.validated()
        if p.seed is None or p.seed == -1:
            self.seed = secrets.randbits(32)
        else:
            self.seed = p.seed
        self.rng = rng if rng is not None else np.random.default_rng(self.seed)
        n = p.repeat_last_n
        if n == -1:
            n = ctx  # None: unbounded
        self.window = deque(maxlen=n) if n != 0 else deque(maxlen=0)
        self.n_vocab = n_vocab
        self.masked_steps = 0
        self.masked_logits = 0
        self.logit_bias = {int(k): float(v) for k, v in (logit_bias or {}).items()}
        self.constraint = constraint
        self.top_logprobs = top_logprobs
        self.logprobs: list = []

    # -- state -------------------------------------------------------------------------------------------
    def accept(self, token: int) -> None:
        """Record a token (prompt or generated) in the penalty window."""
        if self.window.maxlen != 0:
            self.window.append(int(token))

    def accept_many(self, tokens) -> None:
        for t in tokens:
            self.accept(t)

    def reset(self) -> None:
        """Empty the penalty window (the RNG goes on)."""
        self.window.clear()

    # -- the chain ---------------------------------------------------------------------------------------
    def _finite(self, logits) -> np.ndarray:
        lg = np.asarray(logits)
        if lg.ndim != 1 or lg.size == 0:
            raise ColiError(f"logits: shape {lg.shape} (one row of the vocabulary expected)")
        if self.n_vocab is not None:
            lg = lg[: self.n_vocab]
        lg = lg.astype(np.float64)  # a copy: the caller's row is never changed
        with np.errstate(invalid="ignore", over="ignore"):  # inf - inf: NaN, checked below
            total = lg.sum()
        if math.isfinite(total):  # a NaN or an inf makes the sum one (the full check costs ~5x)
            return lg
        bad = ~np.isfinite(lg)
        if bad.any():
            nb = int(bad.sum())
            if nb == lg.size:
                raise ColiError(f"non-finite logits: all {lg.size} logits are NaN or infinite (the model's output "
                                f"overflowed or a weight is corrupt; try --cpu-act f32 or check the file)")
            self.masked_steps += 1
            self.masked_logits += nb
            lg[bad] = -np.inf
        return lg

    def _penalize(self, lg: np.ndarray) -> None:
        p = self.params
        if not p.penalizes or not self.window:
            return
        toks, counts = np.unique(np.fromiter(self.window, dtype=np.int64), return_counts=True)
        keep = (toks >= 0) & (toks < lg.size)
        toks, counts = toks[keep], counts[keep].astype(np.float64)
        v = lg[toks]
        fin = np.isfinite(v)  # masked entries stay masked
        with np.errstate(over="ignore"):
            v = np.where(v <= 0, v * p.repeat_penalty, v / p.repeat_penalty)
            v = v - counts * p.frequency_penalty - p.presence_penalty
        v = np.clip(v, -_FMAX, _FMAX)  # a huge penalty cannot turn a logit into inf
        lg[toks[fin]] = v[fin]

    def sample(self, logits) -> int:
        """The next token id for one row of logits (does not ``accept`` it: call ``accept`` after).

        Before the chain: ``logit_bias`` ({token id: bias}, OpenAI's: added to the logit; -100 bans, 100
        forces) and ``constraint`` (an object with ``mask(lg)``, setting the logits of tokens its grammar
        forbids to -inf in place, and ``consume(token)``, told the chosen token). With ``top_logprobs`` (an
        int >= 0) each step appends ``(token, logprob, [(id, logprob), ...])`` to ``self.logprobs`` (the most likely
        first, tokens of -inf logprob not listed: :func:`top_ids`): the
        log-softmax of the model's logits (after bias and mask, before penalties, truncation and temperature)."""
        lg = self._finite(logits)
        for t, b in self.logit_bias.items():
            if 0 <= t < lg.size:
                lg[t] += b
        if self.constraint is not None:
            self.constraint.mask(lg)
            if not np.isfinite(lg).any():
                raise ColiError("constrained decoding: the grammar allows no token of the vocabulary")
        tok = self._chain(lg.copy() if self.top_logprobs is not None else lg)
        if self.top_logprobs is not None:
            m = lg.max()
            lp = lg - (m + math.log(np.exp(lg - m).sum()))
            k = self.top_logprobs
            top = top_ids(lp, k) if k else np.zeros(0, np.int64)
            self.logprobs.append((tok, float(lp[tok]), [(int(i), float(lp[i])) for i in top]))
        if self.constraint is not None:
            self.constraint.consume(tok)
        return tok

    def _chain(self, lg: np.ndarray) -> int:
        p = self.params
        self._penalize(lg)
        if p.greedy:
            return int(np.argmax(lg))
        idx, v = self._kept(lg)
        with np.errstate(over="ignore", under="ignore"):
            # (v - max) <= 0 before dividing: no temperature can overflow it; exp gives (0, 1], the max gives 1
            q = np.exp((v - v[0]) / p.temp)
        c = np.cumsum(q)
        j = int(np.searchsorted(c, self.rng.random() * c[-1], side="right"))
        return int(idx[min(j, idx.size - 1)])

    def _kept(self, lg: np.ndarray) -> tuple:
        """The tokens top-k, top-p and min-p keep (llama.cpp's order), most likely first (equal logits by lower
        id): ``(ids int64 [m], their logits f64 [m])`` of ``lg`` (f64 [n], finite or -inf).

        Each filter keeps a prefix of the sorted row, so without top-k (0) the whole row is not sorted (~7 ms a
        token at a 49k vocabulary): min-p's bound (logit >= the largest + log min_p) picks its prefix's ids
        before the sort; else top-p's nucleus is looked for in the top 256, 2,048, ... (:func:`top_ids`), the
        mass of each against the whole row's softmax sum. The prefix's cumulative sums are the full sort's
        (the same values in the same order; only the sum's rounding may differ)."""
        p = self.params
        cut_p = p.top_p < 1.0
        with np.errstate(over="ignore", under="ignore"):
            if p.top_k > 0 or not (cut_p or p.min_p > 0.0):
                idx = top_ids(lg, p.top_k)
                v = lg[idx]
                if cut_p and idx.size > 1:
                    q = np.exp(v - v[0])
                    n = int(np.searchsorted(np.cumsum(q / q.sum()), p.top_p)) + 1
                    idx, v = idx[:n], v[:n]
            else:
                top = lg.max()
                total = np.exp(lg - top).sum() if cut_p else 0.0
                if p.min_p > 0.0:
                    c = np.flatnonzero(lg >= top + math.log(p.min_p))
                    idx = c[np.argsort(-lg[c], kind="stable")]
                else:
                    m = 256
                    while True:
                        idx = top_ids(lg, m)
                        if idx.size < m or np.exp(lg[idx] - top).sum() / total >= p.top_p:
                            break  # every finite token, or the nucleus is among these
                        m *= 8
                v = lg[idx]
                if cut_p and idx.size > 1:
                    n = int(np.searchsorted(np.cumsum(np.exp(v - top) / total), p.top_p)) + 1
                    idx, v = idx[:n], v[:n]
            if p.min_p > 0.0 and idx.size > 1:
                n = int(np.count_nonzero(v >= v[0] + math.log(p.min_p)))
                idx, v = idx[: max(n, 1)], v[: max(n, 1)]
        return idx, v

    def __call__(self, logits) -> int:
        return self.sample(logits)

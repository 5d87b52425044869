"""What a generation returns and how its text and its perplexity windows are cut, apart from the
:class:`coli.engine.Engine` that runs the model: :class:`GenerateResult`, :class:`TextStream`, :class:`StopText`
(stop strings), :class:`PerplexityResult` and :func:`perplexity_windows` (llama-perplexity's chunks).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coli.base.errors import ColiError


@dataclass
class GenerateResult:
    """``ids``: generated token ids; ``text``: their text (cut before a stop string); ``prompt_ids``; timing
    in ``stats``; ``finish_reason``: ``"stop"`` (end-of-generation token or a stop string), ``"length"``
    (``max_tokens`` or the context reached) or ``"cancelled"`` (``should_stop`` said so)."""

    ids: list
    text: str
    prompt_ids: list
    stats: dict = field(default_factory=dict)
    finish_reason: str = "stop"


class StopText:
    """Cuts a text stream at the first of ``stops`` (llama.cpp server's ``find_stopping_strings``): ``push``
    returns the text that is safe to show, holding back a tail that may be the start of a stop string;
    ``hit`` turns True when one matched (the stop string itself is never returned)."""

    def __init__(self, stops):
        self.stops = [s for s in (stops or []) if s]
        self.buf = ""
        self.hit = False
        self.matched = None  # the stop string that matched

    def push(self, s: str) -> str:
        if not self.stops:
            return s
        self.buf += s
        found = [(i, t) for i, t in ((self.buf.find(t), t) for t in self.stops) if i >= 0]
        if found:
            i, self.matched = min(found, key=lambda x: x[0])
            out, self.buf, self.hit = self.buf[:i], "", True
            return out
        hold = 0
        for t in self.stops:
            for k in range(min(len(t) - 1, len(self.buf)), hold, -1):
                if self.buf.endswith(t[:k]):
                    hold = k
                    break
        out = self.buf[: len(self.buf) - hold]
        self.buf = self.buf[len(self.buf) - hold :]
        return out

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


class TextStream:
    """Iterator over the text pieces of one generation (:meth:`Engine.stream`); ``.result`` holds the
    :class:`GenerateResult` once the iteration ended. ``close()`` (or leaving the loop early and dropping
    it) ends the generation after the current token."""

    def __init__(self, gen):
        self._gen = gen
        self.result: GenerateResult | None = None

    def __iter__(self):
        return self

    def __next__(self) -> str:
        try:
            return next(self._gen)
        except StopIteration as e:
            self.result = e.value
            raise

    def close(self):
        self._gen.close()


@dataclass
class PerplexityResult:
    """``nll``: mean nats/token; ``n``: tokens scored; ``ppl`` = exp(nll); ``ppl_err``: llama-perplexity's
    ``+/-``; ``chunks``; ``running``: the estimate after each chunk; ``all_tokens``: which convention;
    ``ctx``: the chunk length (see :meth:`Engine.perplexity`)."""

    nll: float
    n: int
    ppl: float
    ppl_err: float
    chunks: int
    running: list
    all_tokens: bool
    ctx: int


def perplexity_windows(ids: np.ndarray, n_ctx: int, bos, all_tokens: bool, name: str = "text") -> tuple[list, int]:
    """The windows of :meth:`coli.engine.Engine.perplexity` (int64 arrays of at most ``n_ctx`` ids) and the first
    position scored in each (its next token is the first predicted): llama-perplexity's chunks of ``n_ctx`` with
    the first id replaced by ``bos`` (an id, or None when the file adds none), scored from ``n_ctx // 2``; with
    ``all_tokens`` windows of ``n_ctx`` from position 0, each led by the BOS when ``ids`` start with it.
    ColiError for a text (named ``name``: the CLI's file) or a ``--ctx`` too short to score a token."""
    windows: list = []
    need = 2 if all_tokens else 3  # a window scores ctx - 1 tokens (--all-tokens) or ctx - 1 - ctx // 2
    if n_ctx < need:
        raise ColiError(f"--ctx {n_ctx}: perplexity scores no token with fewer than {need} positions per chunk"
                        + ("" if all_tokens else " (llama-perplexity's convention scores its second half)"))
    if not all_tokens:
        if len(ids) < 2 * n_ctx:
            raise ColiError(f"{name}: {len(ids)} tokens; llama-perplexity's convention needs at least 2 x --ctx = "
                            f"{2 * n_ctx} (lower --ctx, or score every token with --all-tokens)")
        for i in range(len(ids) // n_ctx):
            w = ids[i * n_ctx : (i + 1) * n_ctx].copy()
            if bos is not None:
                w[0] = bos
            windows.append(w)
        return windows, n_ctx // 2
    prefix = ids[:1] if bos is not None and ids[0] == bos else ids[:0]
    body = ids[len(prefix):]
    step = n_ctx - len(prefix)
    if len(ids) < 2 or step < 1:
        raise ColiError(f"{name}: {len(ids)} tokens with --ctx {n_ctx}: nothing to score")
    for s in range(0, len(body), step):
        w = np.concatenate([prefix, body[s : s + step]])
        if len(w) >= 2:
            windows.append(w)
    return windows, 0


def check_max_tokens(max_tokens, name: str = "max_tokens") -> int:
    """``max_tokens`` as an int: 0 or more, or -1 for up to the end of the context (``Engine.check_fits``; the CLI
    checks ``-n`` with it before the model loads). One-line ColiError naming ``name`` for a non-integer or a count
    below -1 (llama.cpp's -2, "until the context is full", is coli's -1)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)):
        raise ColiError(f"{name}: {max_tokens!r} is not an integer")
    if max_tokens < -1:
        raise ColiError(f"{name}: {max_tokens} tokens to generate (at least 0, or -1 for up to the end of the context)")
    return int(max_tokens)


def check_ids(ids, vocab: int) -> np.ndarray:
    """``ids`` as int64 [T]: ColiError for an empty list, something not integers (1.5, "abc": never
    truncated), or an id outside the vocabulary (naming the first such id)."""
    if isinstance(ids, (str, bytes)):
        raise ColiError(f"token ids: {ids[:20]!r}... is text, not token ids (give the prompt as text instead)")
    try:
        raw = np.asarray(ids)
    except (TypeError, ValueError) as e:
        raise ColiError(f"token ids: not a list of integers ({e})") from None
    if raw.size == 0:
        raise ColiError("prompt: empty (no tokens to run)")
    if raw.dtype.kind not in "iu":
        if raw.dtype.kind == "f" and np.isfinite(raw).all() and (raw == np.round(raw)).all():
            raw = raw.astype(np.int64)
        else:
            raise ColiError(f"token ids: {raw.reshape(-1)[:8].tolist()}... are not integers")
    ids = raw.astype(np.int64).reshape(-1)
    bad = (ids < 0) | (ids >= vocab)
    if bad.any():
        i = int(np.argmax(bad))
        raise ColiError(f"token ids: id {int(ids[i])} at index {i} is outside the vocabulary of {vocab}")
    return ids

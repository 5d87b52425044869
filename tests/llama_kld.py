"""llama-perplexity's logits file (``--kl-divergence-base``; llama.cpp tools/perplexity/perplexity.cpp: ``_logits_``,
n_ctx, n_vocab, n_chunk, the tokens, then per scored token the log-softmax as uint16 steps of (max - min) / 65535
over the range down to 16 below the largest logit), for the tests that compare coli's perplexity with llama.cpp's."""
from pathlib import Path

import numpy as np


def read_kld(path: Path):
    """(n_ctx, n_vocab, n_chunk, tokens int32 [n_chunk * n_ctx], logp of the scored next tokens f64 [n_chunk,
    n_ctx - 1 - n_ctx // 2]; NaN where the file clipped it)."""
    b = path.read_bytes()
    if b[:8] != b"_logits_":
        raise ValueError(f"{path}: not a llama-perplexity logits file (no _logits_ magic)")
    n_ctx, n_vocab, n_chunk = np.frombuffer(b, np.int32, 3, 8)
    off = 20
    toks = np.frombuffer(b, np.int32, n_chunk * n_ctx, off)
    off += 4 * n_chunk * n_ctx
    nv = 2 * ((n_vocab + 1) // 2) + 4
    first = n_ctx // 2
    n_tok = n_ctx - 1 - first
    rec = np.frombuffer(b, np.uint16, n_chunk * n_tok * nv, off).reshape(n_chunk, n_tok, nv)
    head = rec[:, :, :4].copy().view(np.float32)  # [scale, min_log_prob]
    out = np.empty((n_chunk, n_tok))
    for c in range(n_chunk):
        tgt = toks[c * n_ctx + first + 1:(c + 1) * n_ctx]
        q = rec[c, np.arange(n_tok), 4 + tgt].astype(np.float64)
        # q = 0 where the range was cut at 16 below the largest logit: the logit was at or below the cut, its
        # value unknown (NaN, left out of the means); where the range is narrower, q = 0 is the smallest logit
        cut = head[c, :, 0].astype(np.float64) * 65535 > 16 - 1e-3
        out[c] = np.where((q > 0) | ~cut, head[c, :, 1] + head[c, :, 0] * q, np.nan)
    return int(n_ctx), int(n_vocab), int(n_chunk), toks.copy(), out

"""HF transformers' per-token NLL for the real Gemma-3-270M Q4_K_M, scored as llama-perplexity scores (docs/oracles.md,
"The real Gemma-3-270M: perplexity per token"; tests/models/test_perplexity.py checks coli against it): never made by
default (``make.py gemma3_ppl [--gguf GGUF]``; GGUF: the file ``coli.fetch`` caches as ``gemma3``).

transformers loads the file with its own GGUF reader (every tensor dequantized by ``gguf.quants`` to float32; the
Gemma norms' stored 1 + w taken back to w) and its tokenizer from the file's vocabulary. The text is tokenized
by HF, cut into chunks of ``CTX`` tokens, each chunk's first token replaced by BOS, and the second half of
each chunk scored (llama-perplexity's convention: ``CTX - 1 - CTX // 2`` tokens per chunk); NLLs in float64
from float32 logits.

``gemma3_270m_ppl.json``: ``text``, ``ctx``, ``gguf`` (file name, size in bytes, sha256), ``tokens`` (int [n_chunk * ctx],
as tokenized, before the BOS replacement), ``nll`` (float [n_chunk][ctx - 1 - ctx // 2], nats), ``ppl``,
``versions`` (torch, transformers, gguf).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math

import numpy as np

NAMES = ["gemma3_ppl"]
# tests/models/test_perplexity.py's TEXT, four times
TEXT = ("The old lighthouse stood at the end of the rocky point, where the sea met the sky in a line of grey. "
        "Every night the keeper climbed the narrow stairs, trimmed the wick, and watched the beam sweep across "
        "the water. Ships passed safely because of him, though few of their sailors ever knew his name.") * 4
CTX = 32


def make(name: str, ctx) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_path = ctx.args.gguf, ctx.out / "gemma3_270m_ppl.json"
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).eval()
    ids = tok(TEXT)["input_ids"]
    assert ids[0] == tok.bos_token_id, "the file asks for BOS first"
    n_chunk = len(ids) // CTX
    first = CTX // 2
    tokens = ids[: n_chunk * CTX]
    nll = []
    with torch.no_grad():
        for c in range(n_chunk):
            w = list(tokens[c * CTX:(c + 1) * CTX])
            w[0] = tok.bos_token_id
            lg = model(torch.tensor([w])).logits[0].double().numpy()
            m = lg.max(axis=1, keepdims=True)
            lse = m[:, 0] + np.log(np.exp(lg - m).sum(axis=1))
            pos = np.arange(first, CTX - 1)
            nll.append((lse[pos] - lg[pos, np.asarray(w)[pos + 1]]).tolist())
    data = gguf_path.read_bytes()
    out = {"text": TEXT, "ctx": CTX,
           "gguf": {"name": gguf_path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()},
           "tokens": tokens, "nll": nll, "ppl": math.exp(float(np.mean(nll))),
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "gguf": importlib.metadata.version("gguf")}}
    out_path.write_text(json.dumps(out, indent=1) + "\n")
    return {"chunks": n_chunk, "tokens_scored": n_chunk * (CTX - 1 - first), "ppl": out["ppl"]}

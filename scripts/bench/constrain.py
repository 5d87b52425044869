"""Constrained-decoding libraries compared on one tokenizer: llguidance, xgrammar, outlines-core. A benchmark
for docs/serve.md "Structured output", not a test.

    python scripts/bench/constrain.py [MODEL] [--extra-path DIR ...]

For each library and JSON schema: the compile time (schema -> grammar/index for this vocabulary), then a
walk along the tokens of a document the schema accepts (the model's own tokenization of compact JSON):
at each token the library's allowed-token mask is computed (timed), then the token is consumed. Prints
the median and 90th-percentile mask time per token (microseconds) and whether every token was allowed.
A library that is not importable (or fails on a schema) is reported as such. ``--extra-path`` adds folders
to the end of ``sys.path`` (a ``pip install --target`` copy of a library kept out of the venv).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

SCHEMAS = {
    "person": ({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"enum": ["python", "c", "rust", "go"]}, "maxItems": 3}},
        "required": ["name", "age", "languages"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "languages": ["python", "c"]}),
    "tool_call": ({"anyOf": [
        {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {
            "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"]}}, "required": ["name", "arguments"], "additionalProperties": False},
        {"type": "object", "properties": {"name": {"const": "search"}, "arguments": {
            "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["query"]}}, "required": ["name", "arguments"], "additionalProperties": False}]},
        {"name": "search", "arguments": {"query": "weather in Paris tomorrow", "limit": 5}}),
    "nested": ({"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
            "price": {"type": "number"}, "ok": {"type": "boolean"}},
            "required": ["id", "tags", "price", "ok"]}}, "note": {"type": ["string", "null"]}},
        "required": ["items", "note"]},
        {"items": [{"id": 1, "tags": ["a", "bb"], "price": 2.5, "ok": True},
                   {"id": 22, "tags": [], "price": -1.25, "ok": False}], "note": None}),
}


def vocab(model):
    from coli.gguf_file import open_gguf
    from coli.tokenizer import CONTROL, Tokenizer

    tok = Tokenizer.from_gguf(open_gguf(model))
    pieces = [tok.piece_bytes(i) for i in range(tok.vocab_size)]
    special = {i for i in range(tok.vocab_size) if int(tok.token_type[i]) == CONTROL}
    return tok, pieces, special


def walk(mask_fn, consume_fn, ids, n_vocab):
    times, ok = [], True
    for t in ids:
        t0 = time.perf_counter()
        allowed = mask_fn()
        times.append(time.perf_counter() - t0)
        ok &= bool(allowed[t])
        consume_fn(t)
    return times, ok


def unpack(bits, n):
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:n].view(bool)


def run_llguidance(tok, pieces, special, schema, ids):
    import llguidance

    from coli.constrain import JSON_OPTIONS, lltokenizer

    t0 = time.perf_counter()
    llt = lltokenizer(tok)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    m = llguidance.LLMatcher(llt, g, log_level=0)
    assert not m.is_error(), m.get_error()
    t_comp = time.perf_counter() - t0
    n = tok.vocab_size
    bits = np.zeros((n + 31) // 32, np.int32)

    def mask():
        m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        return unpack(bits, n)

    return t_tok, t_comp, walk(mask, m.consume_token, ids, n)


def run_xgrammar(tok, pieces, special, schema, ids):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo([b"" if i in special else p for i, p in enumerate(pieces)],
                             vocab_type=xgr.VocabType.RAW, vocab_size=len(pieces),
                             stop_token_ids=sorted(tok.eos_ids))
    comp = xgr.GrammarCompiler(info, max_threads=2)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    cg = comp.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    m = xgr.GrammarMatcher(cg)
    t_comp = time.perf_counter() - t0
    bm = xgr.allocate_token_bitmask(1, len(pieces))
    n = len(pieces)

    def mask():
        m.fill_next_token_bitmask(bm)
        return unpack(bm[0].numpy(), n)

    return t_tok, t_comp, walk(mask, m.accept_token, ids, n)


def run_outlines(tok, pieces, special, schema, ids):
    import outlines_core as oc

    t0 = time.perf_counter()
    eos = min(tok.eos_ids)
    mp: dict = {}
    for i, p in enumerate(pieces):
        if i not in special and i != eos and p:
            mp.setdefault(p, []).append(i)
    voc = oc.Vocabulary(eos, mp)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    regex = oc.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern="")
    index = oc.Index(regex, voc)
    guide = oc.Guide(index)
    t_comp = time.perf_counter() - t0
    n = len(pieces)
    words = (n + 31) // 32
    bits = np.zeros(words, np.int32)

    def mask():
        guide.write_mask_into(bits.ctypes.data, words, 4)
        return unpack(bits, n)

    return t_tok, t_comp, walk(mask, guide.advance, ids, n)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="qwen25")
    ap.add_argument("--extra-path", nargs="*", default=[])
    a = ap.parse_args()
    sys.path.extend(a.extra_path)
    from coli.fetch import resolve

    tok, pieces, special = vocab(resolve(a.model))
    print(f"vocabulary: {len(pieces)} tokens; load average {open('/proc/loadavg').read().split()[0]}")
    for lib, fn in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar), ("outlines-core", run_outlines)):
        for name, (schema, doc) in SCHEMAS.items():
            ids = tok.encode(json.dumps(doc, separators=(",", ":")), add_bos=False)
            try:
                t_tok, t_comp, (times, ok) = fn(tok, pieces, special, schema, ids)
            except ImportError as e:
                print(f"{lib:14s} not importable: {e}")
                break
            except Exception as e:  # noqa: BLE001  (a library that cannot take the schema: reported)
                print(f"{lib:14s} {name:10s} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            us = sorted(t * 1e6 for t in times)
            print(f"{lib:14s} {name:10s} tokenizer {t_tok * 1e3:7.0f} ms  compile {t_comp * 1e3:8.1f} ms  "
                  f"mask median {statistics.median(us):8.1f} us  p90 {us[int(0.9 * (len(us) - 1))]:8.1f} us  "
                  f"({len(ids)} tokens, all allowed: {ok})")


if __name__ == "__main__":
    main()

"""The Python API around generation: stop strings, the streaming iterator, chat, the kept KV cache,
cancellation, errors naming API arguments, close() and the close at interpreter exit."""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys

import pytest

from conftest import ROOT

from coli.engine import StopText
from coli.base.errors import ColiError

P = "The capital of France is"


@pytest.fixture(scope="module")
def eng(model_path, engine):
    return engine(model_path("smollm2"), cpu_act="f32", ctx=512)


def test_stop_text_against_str_find():
    """StopText over random texts cut in random pieces: what it lets out is exactly the text before the first
    occurrence of a stop string in the text up to the first piece after which one occurs (str.find on each
    prefix, as a generator that checks after each token), or the whole text when none occurs."""
    rnd = random.Random(0)
    for _ in range(2000):
        text = "".join(rnd.choice("abc ") for _ in range(rnd.randint(0, 30)))
        stops = ["".join(rnd.choice("abc ") for _ in range(rnd.randint(1, 4))) for _ in range(rnd.randint(1, 3))]
        cuts = sorted(rnd.sample(range(len(text) + 1), min(len(text) + 1, rnd.randint(0, 6))))
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        st = StopText(stops)
        out = ""
        for p in pieces:
            out += st.push(p)
            if st.hit:
                break
        if not st.hit:
            out += st.flush()
        want, hit, end = text, False, 0
        for p in pieces:  # the oracle: after each piece, str.find of every stop in the whole text so far
            end += len(p)
            found = [i for i in (text[:end].find(s) for s in stops) if i >= 0]
            if found:
                want, hit = text[: min(found)], True
                break
        assert out == want, (text, stops, pieces)
        assert st.hit == hit


def test_generate_stop(eng):
    """``stop=[...]``: the text ends before the first stop string of the unstopped text, finish "stop"."""
    full = eng.generate(P, max_tokens=12)
    assert full.finish_reason == "length" and len(full.ids) == 12
    stop = re.findall(r" \S+", full.text)[1]  # a word after a space, in the middle of the text
    assert full.text.find(stop) > 0
    r = eng.generate(P, max_tokens=12, stop=["@@", stop])
    assert r.text == full.text[: full.text.find(stop)] and r.finish_reason == "stop"
    assert r.ids == full.ids[: len(r.ids)]


def test_stream_iterator_equals_generate(eng):
    """``Engine.stream`` yields pieces that concatenate to ``generate``'s text; ``.result`` has the same ids."""
    want = eng.generate(P, max_tokens=10)
    s = eng.stream(P, max_tokens=10)
    pieces = list(s)
    assert "".join(pieces) == want.text and len(pieces) > 1
    assert s.result.ids == want.ids and s.result.finish_reason == want.finish_reason


def test_chat_keeps_kv_prefix(eng):
    """``Engine.chat``: the answer equals ``generate`` on the template's ids from a fresh cache; a second
    turn reuses at least the first turn's prompt from the kept KV cache and answers as a fresh run does
    (f32 activations)."""
    m1 = [{"role": "user", "content": "What is the capital of France?"}]
    fresh = eng.generate(ids=eng.chat_ids(m1), max_tokens=8)
    a1 = eng.chat(m1, max_tokens=8)
    assert a1.text == fresh.text
    m2 = m1 + [{"role": "assistant", "content": a1.text}, {"role": "user", "content": "And Italy?"}]
    a2 = eng.chat(m2, max_tokens=8)
    assert a2.stats["cached_tokens"] >= len(a1.prompt_ids)
    assert a2.text == eng.generate(ids=eng.chat_ids(m2), max_tokens=8).text


def test_should_stop_cancels(eng):
    """``should_stop`` is polled between tokens: stopping after 3 tokens gives 3 tokens, finish "cancelled"."""
    n = []
    r = eng.generate(P, max_tokens=20, stop_at_eos=False, on_text=lambda s: n.append(s),
                     should_stop=lambda: len(n) >= 3)
    assert r.finish_reason == "cancelled" and len(r.ids) == 3


def test_max_tokens_minus_one_and_errors_name_api_arguments(eng):
    """``max_tokens=-1`` runs to the end of the context; errors from the API name the argument, not the CLI
    flag."""
    ids = eng.tokenize(P)
    assert eng.check_fits(len(ids), -1) == eng.ctx - len(ids)
    with pytest.raises(ColiError, match=r"^max_tokens: -5"):
        eng.generate(P, max_tokens=-5)
    with pytest.raises(ColiError, match=r"\(ctx\)$"):
        eng.generate(P, max_tokens=eng.ctx)
    with pytest.raises(ColiError, match=r"^stop: "):
        eng.generate(P, stop=[1, 2])
    with pytest.raises(ColiError, match=r"^messages\[0\]"):
        eng.chat([{"role": "user"}])


def test_closed_engine_raises(model_path):
    """Every generation call after ``close()`` raises one ColiError saying the engine is closed."""
    from coli.engine import Engine

    e = Engine(model_path("smollm2"), ctx=64)
    e.close()
    for call in (lambda: e.generate(P), lambda: e.logits([1, 2]), lambda: e.nll([1, 2, 3]),
                 lambda: e.chat([{"role": "user", "content": "hi"}]), lambda: e.stream(P)):
        with pytest.raises(ColiError, match="closed"):
            call()
    e.close()  # idempotent


def test_close_at_exit_saves_history(demo_path, tmp_path):
    """An Engine the program forgets to close is closed at interpreter exit with a warning, and its routing
    history is saved (tokens = prompt + generated - 1 on the demo MoE)."""
    usage = tmp_path / "h.coli_usage"
    code = (f"import coli; e = coli.Engine({str(demo_path)!r}, usage={str(usage)!r}, ctx=64); "
            f"r = e.generate(ids=[1, 2, 3, 4], max_tokens=3, stop_at_eos=False); print(len(r.ids))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "was not closed" in r.stderr
    doc = json.loads(usage.read_text())
    assert doc["models"][demo_path.name]["tokens"] == 4 + 3 - 1

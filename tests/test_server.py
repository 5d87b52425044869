"""``coli serve`` driven by the real ``openai`` client (and raw HTTP for what the client cannot send), on
SmolLM2 with f32 activations (so the server's greedy text equals the library's: int8 activations can flip a
rounding between a prompt run whole and one resumed from the KV cache, see test_engine).

One server serves the module (``--queue 1``, ``--ctx 512``); tests that depend on the order of requests say
so. The routing-history test starts its own server on the demo MoE."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

CTX = 512
Q = [{"role": "user", "content": "What is the capital of France?"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model, *args, timeout=240):
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-m", "coli", "serve", "-m", str(model), "--port", str(port), "-q",
                          *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while time.time() - t0 < timeout:
        if p.poll() is not None:
            raise AssertionError(f"coli serve exited {p.returncode}: {p.stderr.read()[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return p, base
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    p.kill()
    raise AssertionError("coli serve did not answer /health in time")


def _stop(p):
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def server(model_path):
    p, base = _start(model_path("smollm2"), "--ctx", str(CTX), "--queue", "1", "--cpu-act", "f32")
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    model_id = client.models.list().data[0].id
    yield dict(p=p, base=base, client=client, model=model_id)
    _stop(p)


@pytest.fixture(scope="module")
def ref(model_path, engine):
    """The library on the same file and settings: the oracle of what the server must answer."""
    return engine(model_path("smollm2"), ctx=CTX, cpu_act="f32")


def _health(server):
    return httpx.get(server["base"] + "/health", timeout=10).json()


def test_models_lists_the_file(server, ref):
    """/v1/models names the served file (its stem) and nothing else."""
    ids = [m.id for m in server["client"].models.list().data]
    assert ids == [ref.path.stem]


def test_model_retrieve_and_unsupported_fields(server):
    """GET /v1/models/{id} (client.models.retrieve) answers for the served id, 404 for another; a field the
    server cannot honour (tools, logprobs) is a 400 naming it, not silently ignored."""
    c = server["client"]
    assert c.models.retrieve(server["model"]).id == server["model"]
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=server["model"], messages=Q, max_tokens=2,
                                  tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert e.value.body["param"] == "tools" and e.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=server["model"], prompt="a", max_tokens=2, logprobs=2)
    assert e.value.body["param"] == "logprobs"


def test_chat_non_streamed_equals_library(server, ref):
    """Greedy chat: the text, the token counts and finish_reason equal Engine.chat on the same messages."""
    want = ref.chat(Q, max_tokens=8, temp=0.0, keep_kv=False)
    r = server["client"].chat.completions.create(model=server["model"], messages=Q, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
    assert r.usage.prompt_tokens == len(ref.chat_ids(Q)) == len(want.prompt_ids)
    assert r.usage.completion_tokens == len(want.ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streamed_equals_non_streamed(server, ref):
    """The streamed deltas concatenate to the library's text; the role comes first, finish_reason last, and
    the usage chunk (stream_options.include_usage) counts the same tokens. The same messages were served
    just before (module order), so all but the last prompt token come from the KV cache."""
    want = ref.chat(Q, max_tokens=8, temp=0.0, keep_kv=False)
    chunks = list(server["client"].chat.completions.create(model=server["model"], messages=Q, max_tokens=8,
                                                           temperature=0, stream=True,
                                                           stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    fin = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert fin == ["length" if want.finish_reason == "length" else "stop"]
    u = chunks[-1].usage
    assert u.completion_tokens == len(want.ids) and u.prompt_tokens == len(want.prompt_ids)
    assert u.prompt_tokens_details.cached_tokens == u.prompt_tokens - 1


def test_conversation_reuses_kv_prefix(server):
    """A second turn (first answer appended, a new question) reuses at least the first turn's prompt from the
    KV cache (usage.prompt_tokens_details.cached_tokens)."""
    c = server["client"]
    r1 = c.chat.completions.create(model=server["model"], messages=Q, max_tokens=6, temperature=0)
    msgs = Q + [{"role": "assistant", "content": r1.choices[0].message.content},
                {"role": "user", "content": "And of Italy?"}]
    r2 = c.chat.completions.create(model=server["model"], messages=msgs, max_tokens=4, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
    assert r2.usage.prompt_tokens > r1.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequence(server, ref, stream):
    """``stop``: the text ends right before the stop string's first occurrence in the library's unstopped
    greedy text, finish_reason "stop"; completions endpoint, streamed and not."""
    prompt = "The capital of France is"
    full = ref.generate(prompt, max_tokens=16, temp=0.0).text
    stop = re.findall(r" \S+", full)[1]  # a word after a space, in the middle of the text
    assert full.find(stop) > 0, full
    cut = full[: full.find(stop)]
    kw = dict(model=server["model"], prompt=prompt, max_tokens=16, temperature=0, stop=[stop, "@@never@@"])
    if stream:
        chunks = list(server["client"].completions.create(stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        fin = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        r = server["client"].completions.create(**kw)
        text, fin = r.choices[0].text, [r.choices[0].finish_reason]
    assert text == cut
    assert fin == ["stop"]


def test_two_concurrent_clients_in_order(server, ref):
    """Two clients at once: both answered with the library's greedy text, the first to arrive first (one
    generation at a time, FIFO)."""
    c = server["client"]
    done = {}
    first_chunk = threading.Event()

    def a():
        parts = []
        for ch in c.completions.create(model=server["model"], prompt="Once upon a time", max_tokens=12,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True}):
            first_chunk.set()
            if ch.choices:
                parts.append(ch.choices[0].text)
        done["a"] = ("".join(parts), time.monotonic())

    def b():
        r = c.completions.create(model=server["model"], prompt="The capital of France is", max_tokens=6,
                                 temperature=0)
        done["b"] = (r.choices[0].text, time.monotonic())

    ta = threading.Thread(target=a)
    ta.start()
    assert first_chunk.wait(120)
    tb = threading.Thread(target=b)
    tb.start()
    ta.join(300)
    tb.join(300)
    assert done["a"][0] == ref.generate("Once upon a time", max_tokens=12, temp=0.0, stop_at_eos=False).text
    assert done["b"][0] == ref.generate("The capital of France is", max_tokens=6, temp=0.0).text
    assert done["a"][1] < done["b"][1]


def test_queue_full_is_503_and_dropped_stream_stops(server):
    """With ``--queue 1``: one generation running and one waiting, a third request gets 503 (server_busy).
    Then the running client drops its stream: its generation stops (finish "cancelled", far fewer tokens
    than asked) and the waiting request is answered."""
    base = server["base"]
    h0 = _health(server)
    body = {"model": server["model"], "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
            "stream": True, "ignore_eos": True}
    waiting = {}
    with httpx.Client(timeout=300) as http:
        with http.stream("POST", base + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [ln for ln in (next(lines) for _ in range(3)) if ln.startswith("data:")]
            assert got

            def wait_one():
                waiting["r"] = httpx.post(base + "/v1/completions", timeout=300,
                                          json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})

            t = threading.Thread(target=wait_one)
            t.start()
            t0 = time.time()
            while _health(server)["queued"] < 1 and time.time() - t0 < 60:
                time.sleep(0.1)
            busy = httpx.post(base + "/v1/completions", timeout=60, json={"prompt": "Hi", "max_tokens": 2})
            assert busy.status_code == 503
            assert busy.json()["error"]["code"] == "server_busy"
        # the stream is closed here: the client went away mid-generation
        t.join(300)
    assert waiting["r"].status_code == 200
    h = _health(server)
    assert h["cancelled"] == h0["cancelled"] + 1
    assert h["served"] == h0["served"] + 1


def _wait_cancelled(server, h0):
    """/health once the server counts one more cancelled generation than ``h0`` and is idle (at most 120 s); asserts
    that the last generation ended "cancelled"."""
    t0 = time.time()
    while time.time() - t0 < 120:
        h = _health(server)
        if h["cancelled"] > h0["cancelled"] and not h["busy"]:
            break
        time.sleep(0.2)
    assert h["cancelled"] == h0["cancelled"] + 1
    assert h["last"]["finish_reason"] == "cancelled"
    return h


def test_dropped_stream_last_generation_cancelled(server):
    """A client that reads two events of a 400-token stream and disconnects: the server's last generation
    ends "cancelled" with fewer than 400 tokens (it did not run on for nobody)."""
    base = server["base"]
    h0 = _health(server)
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=300) as http:
        with http.stream("POST", base + "/v1/completions", json=body) as resp:
            it = resp.iter_lines()
            next(it)
            next(it)
    h = _wait_cancelled(server, h0)
    assert h["last"]["completion_tokens"] < 400


def test_dropped_request_last_generation_cancelled(server):
    """A client that gives up on a non-streaming 480-token completion after 1 s (tokens keep coming all the while):
    the server's last generation ends "cancelled" with fewer than 480 tokens."""
    base = server["base"]
    h0 = _health(server)
    body = {"prompt": "Once upon a time", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(base + "/v1/completions", json=body, timeout=1)
    h = _wait_cancelled(server, h0)
    assert h["last"]["completion_tokens"] < 480


def test_malformed_json_is_400(server):
    """A body that is not JSON, or a field of the wrong type: 400 with OpenAI's error object, naming the field."""
    r = httpx.post(server["base"] + "/v1/chat/completions", content=b'{"messages": [', timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json"
    with pytest.raises(openai.BadRequestError) as e:
        server["client"].chat.completions.create(model=server["model"], messages=Q, temperature="hot")
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        server["client"].chat.completions.create(model=server["model"], messages=[{"role": "wizard", "content": "x"}])
    assert e.value.body["param"] == "messages[0].role"


def test_lone_surrogate_is_400(server):
    """A JSON "\\ud800" escape decodes to a lone surrogate, which no UTF-8 encodes: 400 naming the field and the
    character (coli.tokenizer.check_text), in a completion prompt and in a chat message; the server goes on."""
    for path, body, param in (("/v1/completions", '{"prompt": "hi \\ud800", "max_tokens": 2}', "prompt"),
                              ("/v1/chat/completions",
                               '{"messages": [{"role": "user", "content": "\\udcff"}], "max_tokens": 2}', "messages")):
        r = httpx.post(server["base"] + path, content=body.encode(), timeout=60,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "not valid Unicode: a lone surrogate U+D" in err["message"]
    assert _health(server)["status"] == "ok"


def test_unknown_model_is_404(server):
    """A model name the server does not serve: 404, code model_not_found (OpenAI's answer)."""
    with pytest.raises(openai.NotFoundError) as e:
        server["client"].chat.completions.create(model="gpt-4o", messages=Q, max_tokens=2)
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"


def test_max_tokens_past_context_is_400(server, ref):
    """max_tokens that, with the prompt, exceed the context (512) by one: 400 context_length_exceeded (the
    exact boundary is Engine.check_fits's, tests/test_api.py); the server goes on answering."""
    n = len(ref.chat_ids(Q))
    with pytest.raises(openai.BadRequestError) as e:
        server["client"].chat.completions.create(model=server["model"], messages=Q, max_tokens=CTX - n + 1)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_tokens"
    r = server["client"].chat.completions.create(model=server["model"], messages=Q, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens <= 2 and r.choices[0].finish_reason in ("stop", "length")


def test_sigterm_saves_routing_history(demo_path, tmp_path):
    """On the demo MoE: after one answer, SIGTERM ends the server with status 0 and the routing history file
    holds every token that went through the MoE layers (prompt + generated - 1: the last sampled token is
    never run)."""
    usage = tmp_path / "hist.coli_usage"
    p, base = _start(demo_path, "--usage", str(usage), "--ctx", "256")
    try:
        r = httpx.post(base + "/v1/completions", timeout=300,
                       json={"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200
        u = r.json()["usage"]
        assert not usage.exists()
    finally:
        p.send_signal(signal.SIGTERM)
        rc = p.wait(120)
    assert rc == 0, p.stderr.read()[-2000:]
    doc = json.loads(usage.read_text())
    ent = doc["models"][demo_path.name]
    assert ent["tokens"] == u["prompt_tokens"] + u["completion_tokens"] - 1

"""``coli serve`` driven by the real ``openai`` client (and raw HTTP for what the client cannot send), on
SmolLM2 with f32 activations (so the server's greedy text equals the library's: int8 activations can flip a
rounding between a prompt run whole and one resumed from the KV cache, see test_engine).

One server serves the module (``--queue 1``, ``--ctx 2048``, ``--port 0``); tests that depend on the order of
requests say so. The signal tests start their own servers; the tool-call and structured-output tests one on
Qwen2.5-Coder-0.5B (its chat template renders tools)."""
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

CTX = 2048
Q = [{"role": "user", "content": "What is the capital of France?"}]


def _start(model, *args, timeout=300):
    """A ``coli serve`` process on a free port (``--port 0``: the port is read from its serving line), prompts read
    in steps of 64 rows (``COLI_UBATCH``: many steps a prompt, for the stop between two)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLI_UBATCH="64")
    p = subprocess.Popen([sys.executable, "-m", "coli", "serve", "-m", str(model), "--port", "0", "-q", *args],
                         cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list = []
    threading.Thread(target=lambda: lines.extend(p.stderr), daemon=True).start()
    t0 = time.time()
    while time.time() - t0 < timeout:
        m = [re.search(r"serving \S+ on http://127\.0\.0\.1:(\d+)/v1", ln) for ln in list(lines)]
        m = [x for x in m if x]
        if m:
            base = f"http://127.0.0.1:{m[0].group(1)}"
            assert int(m[0].group(1)) != 0
            if httpx.get(base + "/health", timeout=10).status_code == 200:
                p.lines = lines
                return p, base
        if p.poll() is not None:
            time.sleep(0.5)
            raise AssertionError(f"coli serve exited {p.returncode}: {''.join(lines)[-2000:]}")
        time.sleep(0.3)
    p.kill()
    raise AssertionError("coli serve did not print its serving line in time")


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
    # one slot (-np 1; the default is 4): the queue's order, its limit and the waiting requests are what it tests
    p, base = _start(model_path("smollm2"), "--ctx", str(CTX), "--queue", "1", "--cpu-act", "f32", "-np", "1")
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    model_id = client.models.list().data[0].id
    yield dict(p=p, base=base, client=client, model=model_id)
    _stop(p)


@pytest.fixture(scope="module")
def ref(model_path, engine):
    """The library on the same file and settings: the oracle of what the server must answer."""
    return engine(model_path("smollm2"), ctx=CTX, cpu_act="f32")


def _health(server):
    return _health_at(server["base"])


def _health_at(base):
    return httpx.get(base + "/health", timeout=10).json()


def test_models_lists_the_file(server, ref):
    """/v1/models names the served file (its stem) and nothing else."""
    ids = [m.id for m in server["client"].models.list().data]
    assert ids == [ref.path.stem]


def test_warmup_ran_before_the_first_request(server):
    """``coli serve`` warms up by default: /health (200 once ready) counts the warm-up's two model steps. With
    ``-q`` the serving line and, after it, the warm-up line stay (llama-server's warm-up line is a warning): a
    first run's compile is minutes of nothing otherwise; the ready line is not printed."""
    assert _health(server)["warmup"]["steps"] == 2
    lines = "".join(server["p"].lines).splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("coli: serving "))
    assert lines[i + 1].startswith("coli: warming up the model (") and "--no-warmup" in lines[i + 1], lines
    assert not any(ln.startswith("coli: ready") for ln in lines), lines


def test_model_retrieve_and_unsupported_fields(server):
    """GET /v1/models/{id} (client.models.retrieve) answers for the served id, 404 for another; a field the
    server cannot honour (the legacy ``functions``) is a 400 naming it, not silently ignored."""
    c = server["client"]
    assert c.models.retrieve(server["model"]).id == server["model"]
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=server["model"], messages=Q, max_tokens=2,
                                  functions=[{"name": "f", "parameters": {}}])
    assert e.value.body["param"] == "functions" and e.value.body["code"] == "unsupported_parameter"
    for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": Q})):
        r = httpx.post(server["base"] + path, json={**body, "max_tokens": 2, "echo": True}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter", r.text
        assert r.json()["error"]["param"] == "echo"


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


def test_any_model_name_is_answered(server):
    """One model is served: a request naming another (an agent's default "gpt-4o") is answered by it, and the
    answer names the served model (llama-server's behaviour; docs/serve.md says why)."""
    r = server["client"].chat.completions.create(model="gpt-4o", messages=Q, max_tokens=2, temperature=0)
    assert r.model == server["model"]


def test_dropped_long_prompt_frees_the_server_within_a_chunk(server):
    """A client that gives up while a ~1,000-token prompt is being read: the server stops between two prompt
    chunks (64 tokens: ``_start``'s COLI_UBATCH) rather than reading the rest. The same prompt sent again finds in
    the KV cache only the chunks read before the stop: a whole number of chunks, fewer than the prompt's."""
    base = server["base"]
    h0 = _health(server)
    prompt = " ".join(f"item {i} is {i * 7 % 13}." for i in range(170))
    body = {"prompt": prompt, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(base + "/v1/completions", json=body, timeout=1)
    h = _wait_cancelled(server, h0)
    assert h["last"]["completion_tokens"] == 0  # stopped while reading the prompt
    r = httpx.post(base + "/v1/completions", json={**body, "max_tokens": 1}, timeout=300).json()
    n, cached = r["usage"]["prompt_tokens"], r["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert n > 900
    assert 0 < cached < n - 64 and cached % 64 == 0, (cached, n)


def test_max_tokens_past_context_is_400(server, ref):
    """max_tokens that, with the prompt, exceed the context (512) by one: 400 context_length_exceeded (the
    exact boundary is Engine.check_fits's, tests/models/test_api.py); the server goes on answering."""
    n = len(ref.chat_ids(Q))
    with pytest.raises(openai.BadRequestError) as e:
        server["client"].chat.completions.create(model=server["model"], messages=Q, max_tokens=CTX - n + 1)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_tokens"
    r = server["client"].chat.completions.create(model=server["model"], messages=Q, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens <= 2 and r.choices[0].finish_reason in ("stop", "length")


def test_sigterm_saves_routing_history(demo_path, tmp_path):
    """On the demo MoE: after one answer, SIGTERM ends the server with status 0 (a stop asked for, as
    llama-server's) and the routing history file holds every token that went through the MoE layers (prompt +
    generated - 1: the last sampled token is never run)."""
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
    assert rc == 0, "".join(p.lines)[-2000:]
    doc = json.loads(usage.read_text())
    ent = doc["models"][demo_path.name]
    assert ent["tokens"] == u["prompt_tokens"] + u["completion_tokens"] - 1


def test_sigterm_cuts_a_stream_visibly(model_path):
    """SIGTERM while a stream runs: the stream ends with an error event (code shutting_down), no
    finish_reason "stop" and no [DONE] (a cut answer must not read as complete); the process exits 0."""
    p, base = _start(model_path("smollm2"), "--ctx", "512", "--no-warmup", "-np", "1")   # a second request waits
    assert httpx.get(base + "/health", timeout=10).json()["warmup"] is None  # --no-warmup: none ran
    assert not any("warming up" in ln for ln in p.lines), p.lines  # and says none
    events, queued = [], []
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:  # a second request waits behind the stream (one slot), then SIGTERM
                    t = threading.Thread(target=lambda: queued.append(httpx.post(
                        base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=120)))
                    t.start()
                    t0 = time.time()
                    while _health_at(base)["queued"] < 1 and time.time() - t0 < 60:
                        time.sleep(0.05)
                    p.send_signal(signal.SIGTERM)
        t.join(120)
    finally:
        rc = p.wait(120)
    assert rc == 0
    # the waiting request never started: 503 shutting_down (docs/serve.md "Shutdown"), not a client's 499
    assert queued and queued[0].status_code == 503, queued and queued[0].text
    assert queued[0].json()["error"]["code"] == "shutting_down"
    assert "[DONE]" not in events
    last = json.loads(events[-1])
    assert last["error"]["code"] == "shutting_down"
    reasons = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"]]
    assert set(reasons) == {None}


def test_port_taken_is_one_line_before_the_model_loads(model_path):
    """A port another program listens on: exit 2 with one error line naming --port, before the model loads
    (without -q the engine's start line would follow the load)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "coli", "serve", "-m", str(model_path("smollm2")), "--port",
                            str(port)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                           text=True, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"coli: --port {port}:"), r.stderr


def test_host_not_of_this_machine_names_host(model_path):
    """An address no interface here has (TEST-NET-1, RFC 5737): exit 2, one line naming --host, no port hint."""
    r = subprocess.run([sys.executable, "-m", "coli", "serve", "-m", str(model_path("smollm2")), "--host",
                        "192.0.2.1", "--port", "0"], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("coli: --host 192.0.2.1:") and "--port" not in lines[0], r.stderr


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="module")
def qwen(model_path):
    p, base = _start(model_path("qwen25"), "--ctx", "2048")
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    yield dict(p=p, base=base, client=client, model=client.models.list().data[0].id)
    _stop(p)


def test_tool_call_round_trip_with_the_openai_client(qwen):
    """Qwen2.5-Coder-0.5B through the openai client: with tool_choice "required" the answer is a tool call
    (finish_reason tool_calls, the function's name, arguments JSON with the required "city"); the call and its
    result sent back (assistant content null + tool_calls, a "tool" message) get a final answer in words
    that uses the result."""
    c = qwen["client"]
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat.completions.create(model=qwen["model"], messages=msgs, tools=WEATHER, tool_choice="required",
                                  temperature=0, max_tokens=64)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    call = ch.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    assert isinstance(args["city"], str) and "paris" in args["city"].lower()
    msgs += [{"role": "assistant", "content": None, "tool_calls": [
                 {"id": call.id, "type": "function",
                  "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
             {"role": "tool", "tool_call_id": call.id, "content": "{\"temperature_c\": 23, \"sky\": \"sunny\"}"}]
    r2 = c.chat.completions.create(model=qwen["model"], messages=msgs, tools=WEATHER, temperature=0, max_tokens=48)
    m = r2.choices[0]
    assert m.finish_reason in ("stop", "length") and not m.message.tool_calls
    assert "23" in m.message.content, m.message.content


def test_streamed_tool_call_equals_the_whole_answer(qwen):
    """The same forced call streamed: the tool_calls deltas (index 0, id, name, arguments) assemble to the
    non-streamed answer's call; finish_reason tool_calls."""
    c = qwen["client"]
    kw = dict(model=qwen["model"], messages=[{"role": "user", "content": "Weather in Oslo, please."}],
              tools=WEATHER, tool_choice={"type": "function", "function": {"name": "get_weather"}},
              temperature=0, max_tokens=64)
    whole = c.chat.completions.create(**kw).choices[0].message.tool_calls[0].function
    name, args, fins = "", "", []
    for ch in c.chat.completions.create(stream=True, **kw):
        for choice in ch.choices:
            for tc in choice.delta.tool_calls or []:
                assert tc.index == 0
                name += tc.function.name or ""
                args += tc.function.arguments or ""
            if choice.finish_reason:
                fins.append(choice.finish_reason)
    assert (name, json.loads(args)) == (whole.name, json.loads(whole.arguments))
    assert fins == ["tool_calls"]


def test_json_schema_answer_validates(qwen):
    """response_format json_schema: the answer is JSON that the schema validates (jsonschema, the reference
    implementation); json_object: an object."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"enum": ["python", "c", "rust", "go"]}, "maxItems": 3}},
        "required": ["name", "age", "languages"], "additionalProperties": False}
    c = qwen["client"]
    r = c.chat.completions.create(
        model=qwen["model"], temperature=0, max_tokens=120,
        messages=[{"role": "user", "content": "Describe a programmer as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    doc = json.loads(r.choices[0].message.content)
    jsonschema.validate(doc, schema)
    assert r.choices[0].finish_reason == "stop"
    r = c.chat.completions.create(model=qwen["model"], temperature=0, max_tokens=60,
                                  messages=[{"role": "user", "content": "Give a JSON object with the name and age of a cat."}],
                                  response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=qwen["model"], messages=Q, max_tokens=2,
                                  response_format={"type": "xml"})
    assert e.value.body["param"] == "response_format"

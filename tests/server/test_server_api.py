"""``coli serve``'s OpenAI protocol in process (Starlette's TestClient on the app, no socket): the cases clients
and agent frameworks send that servers get wrong, sampling fields (logprobs, logit_bias, n), the API key,
CORS, /metrics, tool-call parsing of each family's format. SmolLM2 with f32 activations, so the server's
greedy text equals the library's (``Engine.generate`` on the same engine while the server is idle).

The subprocess tests (the real ``openai`` client, disconnects, signals, ports) are in test_server.py."""
from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from coli import tool_calls as TC

CTX = 512
Q = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def eng(model_path):
    from coli.engine import Engine

    e = Engine(model_path("smollm2"), ctx=CTX, cpu_act="f32", save_usage=False)
    e.cli_names = False
    yield e
    e.close()


def _client(eng, **kw):
    from starlette.testclient import TestClient

    from coli.server import create_app

    app = create_app(eng, "smol", **kw)
    app.router.lifespan_context = _keep_open(app.router.lifespan_context, eng)
    return TestClient(app)


def _keep_open(lifespan, eng):
    """The app's lifespan without its engine close (the module's engine serves several apps)."""
    import contextlib

    @contextlib.asynccontextmanager
    async def span(app):
        close, eng.close = eng.close, lambda: None
        try:
            async with lifespan(app):
                yield
        finally:
            eng.close = close
    return span


@pytest.fixture(scope="module")
def http(eng):
    with _client(eng) as c:
        yield c


def _greedy(eng, ids, n, **kw):
    return eng.generate(ids=ids, max_tokens=n, temp=0.0, keep_kv=False, **kw)


def _events(r) -> list:
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


# ------------------------------------------------------------------------------------- the protocol table

def test_max_tokens_with_null_max_completion_tokens(http):
    """A client that sends every field (max_completion_tokens: null next to max_tokens: 5) gets 5 tokens."""
    r = http.post("/v1/chat/completions", json={"messages": Q, "max_tokens": 5, "max_completion_tokens": None,
                                                "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_top_p_zero_is_greedy_and_top_k_minus_one_is_off(http, eng):
    """top_p 0 (the smallest nucleus: the most likely token) at temperature 1 gives the greedy text; top_k -1
    is accepted as "off"."""
    want = _greedy(eng, eng.tokenize("Once upon a time"), 8, stop_at_eos=False).text
    r = http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1,
                                           "top_p": 0, "seed": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "top_k": -1, "seed": 1})
    assert r.status_code == 200, r.text


def test_max_tokens_minus_one_runs_to_the_context_end(http, eng):
    """max_tokens -1 (max_completion_tokens too) is llama-server's n_predict -1, no limit: as the field left out,
    the answer runs to the end of the context (here 4 positions after the prompt: finish_reason "length"), where
    CTX as max_tokens is a 400; 0 and -2 are a 400 naming the field (OpenAI refuses all three)."""
    prompt = "one two three four " * 200
    ids = eng.tokenize(prompt)
    while len(ids) > CTX - 4:
        prompt = prompt[:prompt.rindex(" ", 0, len(prompt) - 1) + 1]
        ids = eng.tokenize(prompt)
    room = CTX - len(ids)
    for field in ("max_tokens", "max_completion_tokens"):
        r = http.post("/v1/completions", json={"prompt": prompt, field: -1, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == room and r.json()["choices"][0]["finish_reason"] == "length"
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": CTX})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    for bad in (0, -2, True):
        r = http.post("/v1/chat/completions", json={"messages": Q, "max_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_bad_seed_streamed_is_400_before_the_stream(http):
    """seed -5 with stream: a 400 JSON error object, not a 200 event stream that carries an error."""
    r = http.post("/v1/chat/completions", json={"messages": Q, "seed": -5, "stream": True, "max_tokens": 2})
    assert r.status_code == 400
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["param"] == "seed"


def test_lone_surrogate_is_400(http):
    """A lone UTF-16 surrogate in a message (valid JSON, not valid Unicode): 400 with OpenAI's error object."""
    raw = b'{"messages": [{"role": "user", "content": "bad \\ud800 text"}], "max_tokens": 2}'
    r = http.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_unicode"
    assert err["param"] == "messages" and "'messages[0].content': not valid Unicode" in err["message"]


@pytest.mark.parametrize("field, depth", [("messages", 100_000), ("response_format", 100_000), ("metadata", 65),
                                          ("messages", 64)])
def test_a_body_nested_too_deep_is_400(http, field, depth):
    """Arrays nested past Python's recursion limit (json.loads' RecursionError) or past MAX_DEPTH (64, the body
    being 1): a 400 naming the field where it can, not a 500 with a traceback in the log; 64 deep is read (and
    refused for what it is: a message that is not an object with a role)."""
    from coli.server_params import MAX_DEPTH

    assert MAX_DEPTH == 64
    inner = "[" * (depth - 1) + "]" * (depth - 1)
    raw = f'{{"max_tokens": 2, "{field}": {inner}}}'.encode()
    r = http.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if depth > 1000:
        assert err["code"] == "invalid_json" and "nests more than 64 arrays or objects" in err["message"]
    elif depth > MAX_DEPTH:
        assert err["param"] == field and err["message"] == f"'{field}': nests more than 64 arrays or objects"
    else:
        assert err["param"] == "messages[0].role" and "nests" not in err["message"]


def test_template_kwargs_reach_the_template(http, eng):
    """chat_template_kwargs and reasoning_effort are variables of the chat template: a template that writes
    them gets a prompt with them (its token count is the library's for the same variables)."""
    tok = eng.tokenizer
    saved = tok.chat_template
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %}NO THINKING {% endif %}"
                         "{% if reasoning_effort is defined %}effort {{ reasoning_effort }} {% endif %}"
                         "<|im_start|>assistant\n")
    try:
        want = len(tok.encode_chat(Q, enable_thinking=False, reasoning_effort="low"))
        plain = len(tok.encode_chat(Q))
        assert want > plain
        r = http.post("/v1/chat/completions", json={"messages": Q, "max_tokens": 1, "reasoning_effort": "low",
                                                    "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == want
        r = http.post("/v1/chat/completions", json={"messages": Q, "max_tokens": 1, "reasoning_effort": "huge"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    finally:
        tok.chat_template = saved


def test_chat_template_file_replaces_the_models(eng, monkeypatch):
    """``--chat-template-file``'s template (``Tokenizer.use_template``) is what a chat renders; its errors name
    the flag and the file, one that does not compile before it is used."""
    from coli.base.errors import ColiError

    tok = eng.tokenizer
    monkeypatch.setattr(tok, "chat_template", tok.chat_template)
    monkeypatch.setattr(tok, "template_where", tok.template_where)
    with pytest.raises(ColiError, match=r"^--chat-template-file bad\.jinja: does not compile: line 1"):
        tok.use_template("{% for %}", "--chat-template-file bad.jinja")
    src = ("{% for m in messages %}<<{{ m.role }}>>{{ m.content }}\n{% endfor %}"
           "{% if m is defined %}{{ raise_exception('no') }}{% endif %}{% if add_generation_prompt %}<<a>>{% endif %}")
    tok.use_template(src.replace("m is defined", "false"), "--chat-template-file t.jinja")
    assert tok.apply_chat_template(Q) == "<<user>>What is the capital of France?\n<<a>>"
    tok.use_template(src.replace("m is defined", "true"), "--chat-template-file t.jinja")
    with pytest.raises(ColiError, match=r"^--chat-template-file t\.jinja: no$"):
        tok.apply_chat_template(Q)


def test_completions_list_of_prompts(http, eng):
    """/v1/completions with a list of prompts (text and token ids): one choice per prompt, in order, each the
    library's greedy text."""
    ps = ["The capital of France is", "Once upon a time"]
    ids = eng.tokenize("1, 2, 3,")
    r = http.post("/v1/completions", json={"prompt": ps + [ids], "max_tokens": 6, "temperature": 0,
                                           "ignore_eos": True})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"]
    assert [c["index"] for c in ch] == [0, 1, 2]
    for c, p in zip(ch, ps):
        assert c["text"] == _greedy(eng, eng.tokenize(p), 6, stop_at_eos=False).text
    assert ch[2]["text"] == _greedy(eng, ids, 6, stop_at_eos=False).text
    assert r.json()["usage"]["completion_tokens"] == 18


def test_body_over_the_limit_is_413(eng):
    """A 50 MB body: 413 at the body limit, OpenAI's error object (``request_too_large``) whether the
    Content-Length says so (answered before the body is read) or the body comes in chunks without a length
    (the limit stops the read). The server answers the next request."""
    with _client(eng, body_limit_mb=16) as c:
        big = b'{"prompt": "' + b"a" * (50 * 2**20) + b'", "max_tokens": 1}'
        r = c.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.headers["content-type"] == "application/json"
        whole = r.json()

        def chunks():
            for k in range(0, len(big), 2**20):
                yield big[k:k + 2**20]

        r = c.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json() == whole and whole["error"]["code"] == "request_too_large"
        assert c.get("/health").json()["status"] == "ok"


def test_health_answers_while_a_large_prompt_is_tokenized(eng, monkeypatch):
    """A large body within the limit (8 MiB of prompt text) is parsed and tokenized off the event loop: while its
    tokenization is held (here until the test lets it go), /health answers 200; then the request is answered.
    Tokenized inside the async handler, /health would wait for it (53 s for a 50 MB body before the fix)."""
    import threading

    entered, gate = threading.Event(), threading.Event()
    real = eng.tokenize

    def held(text, *a, **kw):
        if len(text) > 2**20:
            entered.set()
            assert gate.wait(60)
            return real("The capital of France is")
        return real(text, *a, **kw)

    monkeypatch.setattr(eng, "tokenize", held)
    with _client(eng, body_limit_mb=16) as c:
        got = {}
        big = threading.Thread(target=lambda: got.update(big=c.post("/v1/completions", json={
            "prompt": "a " * (4 * 2**20), "max_tokens": 1, "temperature": 0})))
        big.start()
        assert entered.wait(60)
        health = threading.Thread(target=lambda: got.update(health=c.get("/health")))
        health.start()
        health.join(20)  # the loop is free: at once (a blocked loop would hold it until the gate opens)
        alive = health.is_alive()
        gate.set()
        big.join(120)
        assert not alive and got["health"].status_code == 200, "the event loop was held by the tokenization"
        assert got["big"].status_code == 200 and got["big"].json()["usage"]["completion_tokens"] == 1


def test_warmup_health_503_then_200(eng, monkeypatch):
    """With the warm-up on, /health answers llama-server's 503 "Loading model" and a request a 503 until the
    warm-up ran (held here until the test lets it go, so the 503 is seen); then 200 with the warm-up's two
    model steps (a 2-token prompt and a decode row) counted, and the first answer is the library's with no
    prompt rows reused (the warm-up leaves no cache and no steps). Without it /health says none ran."""
    import threading

    from coli.server import Worker

    gate = threading.Event()
    orig = Worker._warm_up

    def held(self):
        assert gate.wait(60)
        orig(self)

    monkeypatch.setattr(Worker, "_warm_up", held)
    with _client(eng, warmup=True) as c:
        r = c.get("/health")
        assert r.status_code == 503
        assert r.json() == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
        r = c.post("/v1/chat/completions", json={"messages": Q, "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading_model"
        gate.set()
        t_end = time.time() + 900  # on a cold Numba cache the warm-up compiles every kernel (minutes under load)
        while time.time() < t_end:
            r = c.get("/health")
            if r.status_code == 200:
                break
            time.sleep(0.1)
        h = r.json()
        assert r.status_code == 200 and h["status"] == "ok"
        assert h["warmup"]["steps"] == 2 and h["warmup"]["rows"] == 1 and h["warmup"]["seconds"] > 0
        assert h["steps"] == 0 and h["reused_rows"] == 0
        ids = eng.tokenizer.encode_chat(Q)
        r = c.post("/v1/chat/completions", json={"messages": Q, "max_tokens": 6, "temperature": 0})
        assert r.json()["choices"][0]["message"]["content"] == _greedy(eng, ids, 6).text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    with _client(eng) as c:
        h = c.get("/health")
        assert h.status_code == 200 and h.json()["warmup"] is None
    # several slots: a prompt alone, a decode row beside a prompt, two decode rows (the several-row compiled
    # call where the engine has one; this f32 engine has none), a decode row alone
    monkeypatch.setattr(Worker, "_warm_up", orig)
    rows = eng.model.rows_dec
    ran = rows.steps if rows is not None else 0
    with _client(eng, warmup=True, parallel=2) as c:
        t_end = time.time() + 900
        while (r := c.get("/health")).status_code != 200 and time.time() < t_end:
            time.sleep(0.1)
        w = r.json()["warmup"]
        assert (w["steps"], w["rows"]) == (4, 2) and r.json()["steps"] == 0
        assert all(s == 0 for s in (r.json()["slots_busy"], r.json()["reused_rows"]))
    if rows is not None:
        assert rows.steps == ran + 1


def test_conversation_outgrowing_context_drops_oldest_turns(http, eng):
    """A conversation longer than the context: the oldest turns (after the system message) are dropped until
    the prompt leaves a quarter of the context for the answer; the answer says how many
    (``context_shift.dropped_messages`` and the ``X-Context-Dropped-Messages`` header) and its prompt is the
    template's rendering of the kept messages."""
    filler = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)
    msgs = [{"role": "system", "content": "Be brief."}]
    for i in range(8):
        msgs += [{"role": "user", "content": f"Turn {i}: {filler}"}, {"role": "assistant", "content": filler}]
    msgs.append({"role": "user", "content": "Say hi."})
    assert len(eng.tokenizer.encode_chat(msgs)) > CTX
    r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    d = r.json()
    k = d["context_shift"]["dropped_messages"]
    assert k > 0 and k % 2 == 0 and r.headers["X-Context-Dropped-Messages"] == str(k)
    kept = msgs[:1] + msgs[1 + k:]
    n = len(eng.tokenizer.encode_chat(kept))
    assert d["usage"]["prompt_tokens"] == n
    assert n + 4 <= CTX and len(eng.tokenizer.encode_chat(msgs[:1] + msgs[k - 1:])) + CTX // 4 > CTX
    with _client(eng, chat_truncate=None) as c:  # --no-chat-truncate: llama-server's default, a 400
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4})
        e = r.json()["error"]
        assert r.status_code == 400 and e["type"] == "exceed_context_size_error", r.text
        assert e["n_prompt_tokens"] == len(eng.tokenizer.encode_chat(msgs)) and e["n_ctx"] == CTX


def test_fit_conversation_keeps_system_and_last_user_turn():
    """``fit_conversation`` on a one-token-a-character encoder: turns go oldest first, a user turn with the
    messages after it, until prompt + answer room fits the context (keep 1.0) or the prompt is under keep x
    ctx (llama-server's --chat-truncate-max-keep); the system message and the last user turn with what follows
    it stay even when they do not fit; keep None drops nothing (the caller's 400)."""
    from coli.server_params import fit_conversation

    def enc(m):
        return [0] * sum(len(x["content"]) for x in m)

    sys_ = {"role": "system", "content": "s" * 10}
    turns = []
    for i in range(5):
        turns += [{"role": "user", "content": "u" * 20}, {"role": "assistant", "content": "a" * 20}]
    msgs = [sys_] + turns + [{"role": "user", "content": "q" * 10}]  # 220 tokens
    assert fit_conversation(enc, msgs, 300, 10) == (enc(msgs), 0)
    ids, k = fit_conversation(enc, msgs, 200, 10)  # drop until <= 190: one turn (40)
    assert (len(ids), k) == (180, 2)
    ids, k = fit_conversation(enc, msgs, 200, 10, keep=0.5)  # under 100: 3 turns more
    assert (len(ids), k) == (60, 8)
    assert fit_conversation(enc, msgs, 200, 10, keep=None) == (enc(msgs), 0)
    ids, k = fit_conversation(enc, msgs, 10, 5)  # cannot fit: only the system and the last user turn left
    assert (len(ids), k) == (20, 10)
    ending = msgs[:-1] + [{"role": "user", "content": "q" * 10}, {"role": "assistant", "content": "p" * 30}]
    ids, k = fit_conversation(enc, ending, 10, 5)  # a prefilled answer stays with its user turn
    assert (len(ids), k) == (50, 10)


# ------------------------------------------------------------------------------------- sampling fields

def _log_softmax(row):
    row = row.astype(np.float64)
    m = row.max()
    return row - (m + math.log(np.exp(row - m).sum()))


def test_logprobs_equal_the_model_log_softmax(http, eng):
    """Chat logprobs with top_logprobs 3 (greedy): each token's logprob is the log-softmax of the model's logits
    at its position (Engine.logits on the prompt and the tokens before it), its top alternatives are the 3
    largest, the first being the token itself."""
    r = http.post("/v1/chat/completions", json={"messages": Q, "max_tokens": 4, "temperature": 0,
                                                "logprobs": True, "top_logprobs": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]["content"]
    prompt = eng.tokenizer.encode_chat(Q)
    gen = _greedy(eng, prompt, 4, stop_at_eos=False).ids
    assert len(lp) == 4
    rows = eng.logits(prompt + gen[:-1])[len(prompt) - 1:]
    for j, e in enumerate(lp):
        ls = _log_softmax(rows[j][: eng.args.vocab])
        assert e["logprob"] == pytest.approx(ls[gen[j]], abs=2e-3)
        assert bytes(e["bytes"]) == eng.tokenizer.piece_bytes(gen[j])
        top = np.argsort(-ls)[:3]
        assert [a["logprob"] for a in e["top_logprobs"]] == pytest.approx(ls[top].tolist(), abs=2e-3)
        assert e["top_logprobs"][0]["token"] == e["token"]
    r = http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0,
                                           "logprobs": 2, "ignore_eos": True})
    c = r.json()["choices"][0]["logprobs"]
    assert len(c["tokens"]) == len(c["token_logprobs"]) == len(c["top_logprobs"]) == 3
    assert "".join(c["tokens"]) == r.json()["choices"][0]["text"]


def test_logit_bias(http, eng):
    """logit_bias -100 bans the greedy first token (the answer starts with another); +100 on one token makes
    greedy decoding repeat it."""
    ids = eng.tokenize("Once upon a time")
    first = _greedy(eng, ids, 1, stop_at_eos=False).ids[0]
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
                                           "logprobs": 0, "logit_bias": {str(first): -100}})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["logprobs"]["tokens"][0]
    assert got.encode() != eng.tokenizer.piece_bytes(first)
    x = eng.tokenize(" banana")[-1]
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                                           "logit_bias": {str(x): 100}})
    assert r.json()["choices"][0]["text"] == eng.detokenize([x] * 3)
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "logit_bias": {"abc": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_n_choices_with_seeds(http):
    """n 2 with seed s: two choices (index 0, 1), the same as two requests with seeds s and s+1."""
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    r = http.post("/v1/completions", json={**body, "n": 2, "seed": 11})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"]
    assert [c["index"] for c in ch] == [0, 1]
    for i, s in enumerate((11, 12)):
        one = http.post("/v1/completions", json={**body, "seed": s}).json()["choices"][0]["text"]
        assert ch[i]["text"] == one
    assert r.json()["usage"]["completion_tokens"] == 16
    st = http.post("/v1/chat/completions", json={"messages": Q, "n": 2, "seed": 11, "max_tokens": 4,
                                                 "stream": True, "ignore_eos": True})
    ev = _events(st)
    assert {c["index"] for e in ev for c in e["choices"]} == {0, 1}
    assert [c["finish_reason"] for e in ev for c in e["choices"] if c["finish_reason"]] == ["length", "length"]


# ------------------------------------------------------------------------------------- safety, names, metrics

def test_api_key(eng):
    """--api-key: no key or a wrong one is a 401 with OpenAI's error object (Anthropic's on /v1/messages); the key
    (Bearer, or x-api-key) is let through; /health and /v1/models stay public."""
    with _client(eng, api_key="s3cret") as c:
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.json()["error"]["type"] == "authentication_error"  # llama-server's type
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                   headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                   headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/v1/models").status_code == 200
        assert c.get("/metrics").status_code == 401
        # /v1/messages answers in Anthropic's error object, and takes Anthropic's x-api-key header
        body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
        r = c.post("/v1/messages", json=body)
        assert r.status_code == 401 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "authentication_error" and "x-api-key" in r.json()["error"]["message"]
        assert c.post("/v1/messages", json=body, headers={"x-api-key": "s3cret"}).status_code == 200


def test_cors_localhost_only_unless_given(eng):
    """Browsers on localhost origins may call the server, others not (no Access-Control-Allow-Origin);
    --cors ORIGIN allows that origin."""
    pre = {"Access-Control-Request-Method": "POST"}
    with _client(eng) as c:
        r = c.options("/v1/chat/completions", headers={"Origin": "http://localhost:3000", **pre})
        assert r.headers.get("access-control-allow-origin") == "http://localhost:3000"
        r = c.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **pre})
        assert "access-control-allow-origin" not in r.headers
        r = c.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers
    with _client(eng, cors=["https://app.example"]) as c:
        r = c.get("/v1/models", headers={"Origin": "https://app.example"})
        assert r.headers.get("access-control-allow-origin") == "https://app.example"


def test_any_model_name_is_served(http):
    """One model is served: any ``model`` name is answered by it (as llama-server), the answer names it."""
    r = http.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": Q, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "smol"
    assert http.get("/v1/models/gpt-4o").status_code == 404


def test_metrics_prometheus_text(http):
    """/metrics: Prometheus text whose counters moved with a request (prompt and generated tokens, a 200)."""
    def scrape():
        out = {}
        for line in http.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, v = line.rsplit(" ", 1)
                out[name] = float(v)
        return out

    m0 = scrape()
    r = http.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 3, "ignore_eos": True})
    u = r.json()["usage"]
    m1 = scrape()
    key = 'coli_requests_total{endpoint="completion",status="200"}'
    assert m1[key] == m0.get(key, 0) + 1
    assert m1["coli_tokens_predicted_total"] == m0["coli_tokens_predicted_total"] + 3
    assert m1["coli_prompt_tokens_total"] == m0["coli_prompt_tokens_total"] + u["prompt_tokens"]
    assert m1["coli_time_to_first_token_seconds_count"] == m0["coli_time_to_first_token_seconds_count"] + 1
    assert m1["coli_requests_deferred"] == 0 and m1["coli_preemptions_total"] == 0


# ------------------------------------------------------------------------------------- tools

WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}]


def test_tool_history_on_a_template_without_tools(http, eng):
    """SmolLM2's template never reads ``tools``: the tools are described in the system message (Hermes's
    words), an assistant turn with content null + tool_calls and a ``tool`` result are written as Hermes
    text; the request is answered (no 400) and its prompt is exactly that rendering."""
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "23 C"}]
    r = http.post("/v1/chat/completions", json={"messages": msgs, "tools": WEATHER, "max_tokens": 2})
    assert r.status_code == 200, r.text
    tools = TC.request_tools({"tools": WEATHER})
    want = eng.tokenizer.encode_chat(TC.without_tool_syntax(
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": None,
          "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "content": "23 C"}], tools))
    assert r.json()["usage"]["prompt_tokens"] == len(want)
    text = eng.tokenizer.decode(want)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n23 C\n</tool_response>" in text and '"name": "get_weather"' in text
    r = http.post("/v1/chat/completions", json={"messages": Q, "tools": WEATHER, "tool_choice": "none",
                                                "max_tokens": 1})
    assert r.status_code == 200


@pytest.mark.parametrize("text, content, calls", [
    ('Let me check.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
     '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>', "Let me check.", [("f", {"a": 1}), ("g", {})]),
    ('<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n'
     '<arg_value>3</arg_value>\n</tool_call>', "", [("get_weather", {"city": "Paris", "days": 3})]),
    ('<|python_tag|>{"name": "f", "parameters": {"x": "y"}}', "", [("f", {"x": "y"})]),
    ('{"name": "f", "parameters": {"x": 2}}', "", [("f", {"x": 2})]),
    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b": 2}}]', "",
     [("f", {"a": 1}), ("g", {"b": 2})]),
    ('[TOOL_CALLS]f[ARGS]{"a": 1}', "", [("f", {"a": 1})]),
    ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"a": 1}\n```'
     '<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "", [("f", {"a": 1})]),
    ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"a": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "",
     [("f", {"a": 1})]),
    ('<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": 1}'
     '<|tool_call_end|><|tool_calls_section_end|>', "", [("f", {"a": 1})]),
    ('<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary '
     'to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>', "", [("f", {"a": 1})]),
    (' to=functions.f<|channel|>commentary json<|message|>{"a": 1}<|call|>', "", [("f", {"a": 1})]),
    ('No call here {not json', "No call here {not json", []),
])
def test_parse_tool_call_formats(text, content, calls):
    """Each family's tool-call syntax (the examples of their model cards / chat templates) parses into the
    same (name, arguments) pairs; text outside the syntax is the content."""
    got_content, got, _ = TC.parse(text, ["f", "g", "get_weather"])
    assert got_content == content
    assert [(n, json.loads(a)) for n, a in got] == calls


def test_streamed_tool_call_deltas_equal_the_whole_parse():
    """The stream parser sends content before a call as it comes, holds the call, and ends with the same
    calls as the whole text's parse (OpenAI's tool_calls deltas with index, id, name and arguments)."""
    from types import SimpleNamespace

    text = 'Sure.<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n</tool_call>'
    fin = TC.Finisher(TC.request_tools({"tools": [{"type": "function", "function": {"name": "f"}}]}))
    sp = fin.stream(0)
    deltas = []
    for k in range(0, len(text), 3):
        deltas += sp.push(text[k:k + 3])
    last, reason = sp.finish(SimpleNamespace(finish_reason="stop"))
    assert "".join(d["content"] for d in deltas) == "Sure."
    assert reason == "tool_calls"
    calls = [d["tool_calls"][0] for d in last if "tool_calls" in d]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [(0, "f", {"a": [1, 2]})]


SYS = "You answer in one short sentence."


def _chat_greedy(eng, msgs, n, **kw):
    return _greedy(eng, eng.tokenizer.encode_chat(msgs), n, **kw)


# ------------------------------------------------------------------------------------- llama-server's test suite

def test_protocol_details_llama_server_tests_check(http, eng):
    """OpenAI-API details llama.cpp's server tests (tools/server/tests/unit) check: the first streamed chat chunk
    has the role and ``content: null``, no later delta an empty content, the final one no content; every chunk
    and the whole answer carry one ``system_fingerprint`` starting with "b"; a prompt past the context is a 400
    of type exceed_context_size_error with n_prompt_tokens and n_ctx, before a stream starts too; a history
    call whose arguments are not JSON is a 400 naming the message and its role; so is a conversation ending
    with two assistant messages."""
    body = {"messages": Q, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    whole = http.post("/v1/chat/completions", json=body).json()
    r = http.post("/v1/chat/completions", json={**body, "stream": True})
    ev = _events(r)
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    deltas = [e["choices"][0]["delta"] for e in ev[1:]]
    assert all("role" not in d and d.get("content", None) != "" for d in deltas) and "content" not in deltas[-1]
    assert "".join(d.get("content") or "" for d in deltas) == whole["choices"][0]["message"]["content"]
    fp = whole["system_fingerprint"]
    assert fp.startswith("b") and {e["system_fingerprint"] for e in ev} == {fp}
    long = [{"role": "user", "content": "What is the best book? " * 200}]
    n = len(eng.tokenizer.encode_chat(long))
    for stream in (False, True):
        r = http.post("/v1/chat/completions", json={"messages": long, "stream": stream})
        e = r.json()["error"]
        assert r.status_code == 400 and e["type"] == "exceed_context_size_error", r.text
        assert e["code"] == "context_length_exceeded" and e["n_prompt_tokens"] == n and e["n_ctx"] == CTX
    bad = Q + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{"}}]}, Q[0]]
    r = http.post("/v1/chat/completions", json={"messages": bad, "max_tokens": 1})
    e = r.json()["error"]
    assert r.status_code == 400 and e["type"] == "invalid_request_error"
    assert "message 1" in e["message"] and "role: assistant" in e["message"]
    two = Q + [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
    r = http.post("/v1/chat/completions", json={"messages": two, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("fmt,want", [
    ({"type": "json_object", "schema": {"const": "42"}}, '"42"'),  # llama-server's schema beside json_object
    ({"type": "sound"}, 400), ({"type": "json_object", "schema": 123}, 400),
    ({"type": "json_object", "schema": {"type": 123}}, 400), ({"type": "json_object", "schema": {"type": "hiccup"}}, 400)])
def test_response_format_schema_and_bad_formats(http, fmt, want):
    r = http.post("/v1/chat/completions", json={"messages": Q, "max_tokens": 6, "response_format": fmt})
    if want == 400:
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    else:
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want, r.text


# ------------------------------------------------------------------------------------- OpenAI's /v1/responses

def test_responses_with_the_openai_client(http, eng):
    """The ``openai`` client on /v1/responses: instructions and an input message get the greedy answer of the
    same chat messages (a ``msg_`` message item, status incomplete at max_output_tokens, usage); streamed, the
    events come in the documented order with one item id and their text deltas join to the same text."""
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="none", http_client=http, max_retries=0)
    want = _chat_greedy(eng, [{"role": "system", "content": SYS}] + Q, 8, stop_at_eos=False)
    kw = dict(model="gpt-anything", instructions=SYS, max_output_tokens=8, temperature=0,
              input=[{"role": "user", "content": [{"type": "input_text", "text": Q[0]["content"]}]}],
              extra_body={"ignore_eos": True})
    res = c.responses.create(**kw)
    assert res.id.startswith("resp_") and res.status == "incomplete" and res.model == "smol"
    assert [o.type for o in res.output] == ["message"] and res.output[0].id.startswith("msg_")
    assert res.output_text == want.text and res.incomplete_details.reason == "max_output_tokens"
    assert res.usage.output_tokens == 8 and res.usage.input_tokens == len(want.prompt_ids)
    kinds, text, final, res_id = [], "", None, None
    for e in c.responses.create(**kw, stream=True):
        kinds.append(e.type)
        if e.type == "response.output_text.delta":
            text += e.delta
            assert e.item_id == res_id
        elif e.type == "response.output_item.added":
            res_id = e.item.id
        elif e.type == "response.incomplete":
            final = e.response
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert text == want.text and final.output_text == want.text and final.output[0].id == res_id


def test_responses_format_tools_and_items(http, eng):
    """text.format json_schema constrains the answer, one without a schema is a 400; a required tool is one
    function_call item whose arguments the schema accepts; input items map to the chat request's messages
    (function_call items join one assistant turn); previous_response_id is a 400 (the server keeps none)."""
    from coli import responses as RS

    base = {"model": "m", "input": "Write an example", "max_output_tokens": 10, "temperature": 0}
    r = http.post("/v1/responses", json={**base, "text": {"format": {"type": "json_schema", "name": "t",
                                                                     "schema": {"const": "foooooo"}}}})
    assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == '"foooooo"', r.text
    r = http.post("/v1/responses", json={**base, "text": {"format": {"type": "json_schema", "name": "t"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format"
    tool = {"type": "function", "name": "test", "parameters": {"type": "object", "properties": {
        "success": {"type": "boolean", "const": True}}, "required": ["success"]}}
    r = http.post("/v1/responses", json={**base, "max_output_tokens": 64, "tools": [tool], "tool_choice": "required"})
    out = r.json()["output"]
    assert [o["type"] for o in out] == ["function_call"] and out[0]["name"] == "test"
    assert json.loads(out[0]["arguments"]) == {"success": True} and out[0]["call_id"]
    r = http.post("/v1/responses", json={**base, "previous_response_id": "resp_1"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
    chat = RS.to_chat({"instructions": "S", "input": [
        {"role": "user", "content": "q"}, {"type": "reasoning", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]}]})
    assert chat["messages"] == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}, {"role": "tool", "tool_call_id": "c2", "content": "2"}]


def test_responses_bad_fields_name_the_field():
    """A Responses request's ``text`` that is not an object, or a function_call_output item without its call_id,
    is a 400 naming the field (not ignored, not a tool message answering no call)."""
    from coli import responses as RS
    from coli.base.errors import APIError

    for body, param in (({"input": "q", "text": "json"}, "text"),
                        ({"input": [{"role": "user", "content": "q"}, {"type": "function_call_output",
                                                                        "output": "1"}]}, "input[1]")):
        with pytest.raises(APIError) as e:
            RS.to_chat(body)
        assert e.value.status == 400 and e.value.param == param, (body, e.value.param)


# ------------------------------------------------------------------------------------- Anthropic's /v1/messages

def test_messages_with_the_anthropic_client(http, eng):
    """The ``anthropic`` client on /v1/messages: a system prompt and a user turn get the greedy answer of the
    same messages through the chat template (text block, stop_reason, usage); streamed (``messages.stream``)
    the text deltas join to the same text and the final message equals the whole one."""
    anthropic = pytest.importorskip("anthropic")
    c = anthropic.Anthropic(base_url=str(http.base_url), api_key="none", http_client=http, max_retries=0)
    want = _chat_greedy(eng, [{"role": "system", "content": SYS}] + Q, 8)
    kw = dict(model="claude-anything", max_tokens=8, system=SYS, extra_body={"temperature": 0},  # not a client arg
              messages=[{"role": "user", "content": [{"type": "text", "text": Q[0]["content"]}]}])
    m = c.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.model == "smol"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want.text
    assert m.stop_reason == ("max_tokens" if want.finish_reason == "length" else "end_turn")
    assert m.usage.output_tokens == len(want.ids)
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == len(want.prompt_ids)
    with c.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == want.text and final.content[0].text == want.text and final.stop_reason == m.stop_reason


def test_messages_stream_events_and_stop_sequence(http, eng):
    """Raw stream events in Anthropic's documented order (message_start, ping, content_block_start,
    content_block_delta..., content_block_stop, message_delta, message_stop); a stop sequence ends the text
    before it with stop_reason "stop_sequence" naming it."""
    want = _chat_greedy(eng, Q, 12, stop_at_eos=False)
    words = want.text.split()
    assert len(words) >= 3, want.text
    stop = " " + words[2]
    r = http.post("/v1/messages", json={"model": "x", "max_tokens": 12, "temperature": 0, "stream": True,
                                        "messages": Q, "stop_sequences": [stop]})
    assert r.status_code == 200
    names, datas = [], []
    for block in r.text.split("\n\n"):
        lines = dict(ln.split(": ", 1) for ln in block.splitlines() if ": " in ln)
        if "event" in lines:
            names.append(lines["event"])
            datas.append(json.loads(lines["data"]))
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert all(d["type"] == n for n, d in zip(names, datas))
    text = "".join(d["delta"]["text"] for d in datas if d["type"] == "content_block_delta")
    assert text == want.text[:want.text.index(stop)]
    assert datas[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    u = datas[-2]["usage"]
    assert u["input_tokens"] + u["cache_read_input_tokens"] == len(want.prompt_ids) and u["output_tokens"] > 0


def _message_stream(http, body) -> tuple:
    """The usage of a streamed /v1/messages answer's message_start and message_delta events."""
    r = http.post("/v1/messages", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    datas = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: ")]
    start = [d["message"]["usage"] for d in datas if d["type"] == "message_start"]
    delta = [d["usage"] for d in datas if d["type"] == "message_delta"]
    assert len(start) == len(delta) == 1, r.text
    return start[0], delta[0]


def test_messages_streamed_usage_splits_the_prompt_as_the_whole_answer(http, eng):
    """A streamed answer's message_start and message_delta split the prompt alike (``input_tokens`` run,
    ``cache_read_input_tokens`` from the prompt cache: message_start waits for the cache lookup), and as the
    non-streamed answer does from the same cache state: a repeated prompt reads all but its last token from the
    slot's cache, whole or streamed."""
    msgs = [{"role": "user", "content": "Name three colours of the rainbow."}]
    n = len(eng.tokenizer.encode_chat(msgs))
    body = {"model": "x", "max_tokens": 3, "temperature": 0, "messages": msgs}
    split = lambda u: (u["input_tokens"], u["cache_read_input_tokens"])  # noqa: E731
    start, delta = _message_stream(http, body)  # a prompt this module sends first here
    assert split(start) == split(delta) and sum(split(start)) == n
    assert start["output_tokens"] == 0 and delta["output_tokens"] == 3
    whole = http.post("/v1/messages", json=body).json()["usage"]
    assert split(whole) == (1, n - 1)  # the slot holds the prompt: only its last token runs
    start, delta = _message_stream(http, body)
    assert split(start) == split(delta) == split(whole)


def test_messages_blocks_map_to_the_chat_request(http):
    """tool_use in an assistant turn and tool_result in a user turn become the chat request's tool_calls and
    tool message; tools and tool_choice map to OpenAI's; an image block is a 400 in Anthropic's error shape."""
    from coli import messages as AM

    body = {"max_tokens": 5, "system": [{"type": "text", "text": "S"}],
            "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "messages": [{"role": "user", "content": "Weather in Oslo?"},
                         {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                                           {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                            "input": {"city": "Oslo"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                       "content": [{"type": "text", "text": "12 C"}]},
                                                      {"type": "text", "text": "Thanks"}]}]}
    o = AM.to_openai(body)
    assert o["messages"] == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "12 C"}, {"role": "user", "content": "Thanks"}]
    assert o["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                                            "parameters": {"type": "object"}}}]
    assert o["tool_choice"] == "required" and o["parallel_tool_calls"] is False
    r = http.post("/v1/messages", json=body)  # SmolLM2 has no tool template: rendered as text, answered
    assert r.status_code == 200 and r.json()["type"] == "message"
    bad = {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}
    r = http.post("/v1/messages", json=bad)
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0]" in r.json()["error"]["message"]
    for mt in (None, -1, 0):  # required and >= 1: the chat path's -1 (no limit) is not Anthropic's
        r = http.post("/v1/messages", json={"messages": Q, **({} if mt is None else {"max_tokens": mt})})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", mt
        assert "'max_tokens'" in r.json()["error"]["message"], mt
    # a tool call in the answer: a tool_use block, stop_reason tool_use, and its events
    msg = {"content": "Let me look.", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    assert AM.content_blocks(msg) == [{"type": "text", "text": "Let me look."},
                                      {"type": "tool_use", "id": "call_1", "name": "get_weather",
                                       "input": {"city": "Oslo"}}]
    assert AM.stop_reason("tool_calls", None, None) == ("tool_use", None)
    ev = AM.Events()
    evs = ev.delta({"content": "Let me look."}) + ev.delta({"tool_calls": [msg["tool_calls"][0]]}) + ev.end(
        "tool_use", None, 9)
    kinds = [(e.split("\n")[0][7:], json.loads(e.split("\n")[1][6:])) for e in evs]
    assert [k for k, _ in kinds] == ["content_block_start", "content_block_delta", "content_block_stop",
                                     "content_block_start", "content_block_delta", "content_block_stop",
                                     "message_delta", "message_stop"]
    assert kinds[3][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}
    assert kinds[4][1]["index"] == 1 and kinds[4][1]["delta"] == {"type": "input_json_delta",
                                                                   "partial_json": '{"city": "Oslo"}'}


# ------------------------------------------------------------------------------------- reasoning (think spans)

def _ds4_template():
    """DeepSeek-V4's chat template, as its oracle GGUF carries it: a thinking prompt ends with ``<think>``
    (the answer starts inside the span), a plain one with ``</think>``."""
    from conftest import ROOT
    from gguf import GGUFReader

    f = GGUFReader(ROOT / "tests/fixtures/oracles/deepseek4.gguf").fields["tokenizer.chat_template"]
    return bytes(f.parts[f.data[0]]).decode()


THINK_TEXTS = [  # (answer, mode, reasoning, content): llama-server's --reasoning-format deepseek reading
    ("<think>\nThe user greets.  I reply.\n</think>\n\nHello there!", "tag", "The user greets.  I reply.",
     "Hello there!"),
    ("\nThe user greets. a < b\n</think>\n\nHello there!", "open", "The user greets. a < b", "Hello there!"),
    ("<think>\nStill thinking when max_tokens cut it", "tag", "Still thinking when max_tokens cut it", ""),
    ("Still thinking when max_tokens cut it", "open", "Still thinking when max_tokens cut it", ""),
    ("Hello <think> there", "tag", None, "Hello <think> there"),
    ("<think>x</think>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>", "tag", "x", None),
]


@pytest.mark.parametrize("text,mode,reasoning,content", THINK_TEXTS)
def test_think_span_streamed_equals_whole(eng, text, mode, reasoning, content):
    """An answer's think span, read whole and streamed token by token (SmolLM2's real tokenizer: its pieces
    split the markers), gives the same reasoning_content and content (and tool call); the Anthropic stream
    events of those deltas carry the reasoning as thinking_delta in a thinking block before the text block."""
    from types import SimpleNamespace

    from coli import messages as AM

    tools = TC.request_tools({"tools": [{"type": "function", "function": {"name": "f"}}]} if "tool_call" in text
                             else {})
    fin = TC.Finisher(tools, think=mode)
    msg, reason = fin(0, text, SimpleNamespace(finish_reason="stop"))
    assert msg.get("reasoning_content") == reasoning and msg["content"] == content
    assert reason == ("tool_calls" if content is None else "stop")
    sp = fin.stream(0)
    dec = eng.tokenizer.stream()
    ids = eng.tokenizer.encode(text, add_bos=False)
    assert len(ids) >= 5
    deltas = [d for t in ids for d in sp.push(dec.push(t))]
    last, reason2 = sp.finish(SimpleNamespace(finish_reason="stop"))
    deltas += last
    assert reason2 == reason
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (reasoning or "")
    assert "".join(d.get("content", "") for d in deltas) == (content or "")
    if reasoning and len(reasoning) > 1:
        assert len([d for d in deltas if "reasoning_content" in d]) > 1  # sent as it came, not at the end
    ev = AM.Events()
    events = [json.loads(e.split("data: ", 1)[1]) for d in deltas for e in ev.delta(d)]
    events += [json.loads(e.split("data: ", 1)[1]) for e in ev.end("end_turn", None, {})]
    kinds = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert kinds == (["thinking"] if reasoning else []) + (["text"] if content else []) + \
        (["tool_use"] if content is None else [])
    thinking = "".join(e["delta"]["thinking"] for e in events if e.get("delta", {}).get("type") == "thinking_delta")
    assert thinking == (reasoning or "")


def test_reasoning_content_and_thinking_blocks_from_the_model(http, eng, monkeypatch):
    """A template whose thinking prompt opens the span (DeepSeek-V4's, on SmolLM2): the model's greedy answer
    comes back as reasoning_content (chat, whole and streamed) and as a thinking block over /v1/messages
    (whole and streamed as thinking_delta events), equal to the library's greedy text of the same prompt; with
    thinking off (the prompt ends ``</think>``) or ``reasoning_format: "none"`` it is the content."""
    monkeypatch.setattr(eng.tokenizer, "chat_template", _ds4_template())
    ids = eng.tokenizer.encode_chat(Q, enable_thinking=True)
    assert eng.tokenizer.decode(ids[-8:]).endswith("<think>")
    want = _greedy(eng, ids, 10).text
    assert "</think>" not in want and want.strip()
    body = {"messages": Q, "max_tokens": 10, "temperature": 0, "chat_template_kwargs": {"enable_thinking": True}}
    m = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert m["reasoning_content"] == want.strip() and m["content"] == ""
    ev = _events(http.post("/v1/chat/completions", json={**body, "stream": True}))
    ds = [c["choices"][0]["delta"] for c in ev if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in ds) == want.strip()
    assert "".join(d.get("content") or "" for d in ds) == ""
    raw = http.post("/v1/chat/completions", json={**body, "reasoning_format": "none"}).json()
    assert raw["choices"][0]["message"]["content"] == want and "reasoning_content" not in raw["choices"][0]["message"]
    off = _greedy(eng, eng.tokenizer.encode_chat(Q, enable_thinking=False), 10).text
    m = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert m["choices"][0]["message"]["content"] == off and "reasoning_content" not in m["choices"][0]["message"]

    amsg = {"model": "x", "max_tokens": 10, "temperature": 0, "messages": Q, "thinking": {"type": "enabled",
                                                                                          "budget_tokens": 1024}}
    r = http.post("/v1/messages", json=amsg).json()
    assert r["content"] == [{"type": "thinking", "thinking": want.strip(), "signature": ""}]
    r = http.post("/v1/messages", json={**amsg, "stream": True})
    datas = [json.loads(b.split("data: ", 1)[1]) for b in r.text.split("\n\n") if "data: " in b]
    starts = [d["content_block"] for d in datas if d["type"] == "content_block_start"]
    assert starts == [{"type": "thinking", "thinking": "", "signature": ""}]
    deltas = [d["delta"] for d in datas if d["type"] == "content_block_delta"]
    assert "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta") == want.strip()
    assert deltas[-1] == {"type": "signature_delta", "signature": ""}
    anthropic = pytest.importorskip("anthropic")
    c = anthropic.Anthropic(base_url=str(http.base_url), api_key="none", http_client=http, max_retries=0)
    with c.messages.stream(model="x", max_tokens=10, messages=Q, thinking={"type": "enabled", "budget_tokens": 1024},
                           extra_body={"temperature": 0}) as s:
        final = s.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == want.strip()
    # thinking enabled switches reasoning on for its request on a server that reads none (--reasoning-format none)
    with _client(eng, reasoning_format="none") as plain:
        r = plain.post("/v1/messages", json=amsg).json()
        assert r["content"] == [{"type": "thinking", "thinking": want.strip(), "signature": ""}]
        r = plain.post("/v1/chat/completions", json=body).json()
        assert r["choices"][0]["message"]["content"] == want


# ------------------------------------------------------------------------------------- forced tool calls per form

WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone.",
                                      "parameters": {"type": "object", "properties": {
                                          "tz": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
                                          "required": ["tz"]}}}]
TQ = [{"role": "system", "content": "You call tools."},  # short: Mistral-Small's own default is 700 tokens
      {"role": "user", "content": "What is the weather in Paris?"}]


def _fixture_template(name):
    from conftest import ROOT

    return (ROOT / "tests/fixtures/templates" / f"{name}.jinja").read_text()


@pytest.mark.parametrize("name,prefix,form", [
    ("mistralai-Mistral-Nemo-Instruct-2407", "[TOOL_CALLS]", "mistral"),
    ("Mistral-Small-3.2-24B-Instruct-2506", "[TOOL_CALLS]", "mistral"),
    ("ibm-granite-granite-3.3-2B-Instruct", "", "generic"),
    ("GLM-4.6", "\n<think></think>\n<tool_call>", "glm"),
    ("llama-cpp-deepseek-r1", "</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>", "deepseek"),
    ("moonshotai-Kimi-K2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.", "kimi"),
    ("openai-gpt-oss-120b", " to=functions.", "harmony"),
])
def test_forced_tool_calls_through_real_templates(http, eng, monkeypatch, name, prefix, form):
    """tool_choice "required" and a named function through real models' chat templates (llama.cpp's copies,
    on SmolLM2): Mistral's ``[TOOL_CALLS]`` opening (a JSON list, or ``NAME[ARGS]{...}`` where the template
    writes ``[ARGS]``), GLM's, DeepSeek-R1's (its prompt's open think span closed first), Kimi K2's and gpt-oss's
    own forms, and llama.cpp's generic JSON form for a template with a syntax of its own (Granite's).
    The prompt is the template's render of the messages and tools (the generic form's instruction in the system
    message) plus the opening; the call is one of the tools (the named one), its arguments valid under the
    function's schema (jsonschema); streamed, the same call; the answer sent back with a tool result renders
    through the template again (Mistral's demand 9-character call ids)."""
    jsonschema = pytest.importorskip("jsonschema")
    from coli import constrain

    monkeypatch.setattr(eng.tokenizer, "chat_template", _fixture_template(name))
    assert TC.template_format(eng.tokenizer.chat_template) == form
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in WEATHER_TOOLS}
    msgs = TQ if form != "generic" else TC.with_system(TQ, constrain.GENERIC_SYSTEM)
    want_prompt = len(eng.tokenizer.encode_chat(msgs, tools=WEATHER_TOOLS)) + \
        len(eng.tokenizer.encode(prefix, add_bos=False) if prefix else [])
    for choice, names in (("required", set(schemas)), ({"type": "function", "function": {"name": "get_time"}},
                                                       {"get_time"})):
        body = {"messages": TQ, "tools": WEATHER_TOOLS, "tool_choice": choice, "parallel_tool_calls": False,
                "max_tokens": 64, "temperature": 0}  # the native forms' markers are many tokens in SmolLM2's vocabulary
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert r.json()["usage"]["prompt_tokens"] == want_prompt
        assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] is None, ch
        (call,) = ch["message"]["tool_calls"]
        fn = call["function"]
        assert fn["name"] in names
        jsonschema.validate(json.loads(fn["arguments"]), schemas[fn["name"]])
        if form == "mistral":
            assert len(call["id"]) == 9 and call["id"].isalnum()
        if form == "kimi":
            assert call["id"] == f"functions.{fn['name']}:0"
        ev = _events(http.post("/v1/chat/completions", json={**body, "stream": True}))
        tcs = [t for c in ev if c["choices"] for t in c["choices"][0]["delta"].get("tool_calls") or []]
        assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in tcs] == \
            [(fn["name"], json.loads(fn["arguments"]))]
        assert ev[-1]["choices"][0]["finish_reason"] == "tool_calls"
        back = TQ + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": '{"result": "sunny"}'}]
        r = http.post("/v1/chat/completions", json={"messages": back, "tools": WEATHER_TOOLS, "max_tokens": 2,
                                                    "temperature": 0})
        if r.status_code != 200:   # nothing to drop (the system message, the question, its call and answer stay)
            e = r.json()["error"]    # llama-server's 400, only where the render does not fit (DeepSeek-R1's: 533)
            assert r.status_code == 400 and e["type"] == "exceed_context_size_error", r.text
            assert e["n_ctx"] == CTX and e["n_prompt_tokens"] + 2 > CTX and form == "deepseek", r.text


def test_forced_call_cut_by_max_tokens(http):
    """A forced call that max_tokens cuts: finish_reason "length" with the call's name and its arguments as far
    as they came (truncated JSON text, vLLM's and OpenAI's answer), streamed too; the cut arguments are the
    start of the uncut call's (whitespace aside)."""
    body = {"messages": TQ, "tools": WEATHER_TOOLS, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    whole = http.post("/v1/chat/completions", json={**body, "max_tokens": 64}).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls", whole
    want = "".join(whole["message"]["tool_calls"][0]["function"]["arguments"].split())
    r = http.post("/v1/chat/completions", json={**body, "max_tokens": 12})
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "length" and ch["message"]["content"] is None, ch
    (call,) = ch["message"]["tool_calls"]
    cut = "".join(call["function"]["arguments"].split())
    assert call["function"]["name"] == "get_time" and cut.startswith("{") and want.startswith(cut) and cut != want
    ev = _events(http.post("/v1/chat/completions", json={**body, "max_tokens": 12, "stream": True}))
    tcs = [t for c in ev if c["choices"] for t in c["choices"][0]["delta"].get("tool_calls") or []]
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in tcs] == \
        [("get_time", call["function"]["arguments"])]
    assert ev[-1]["choices"][0]["finish_reason"] == "length"
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in WEATHER_TOOLS]
    r = http.post("/v1/messages", json={"messages": TQ[1:], "system": TQ[0]["content"], "tools": tools,
                                        "tool_choice": {"type": "tool", "name": "get_time"}, "max_tokens": 12,
                                        "temperature": 0})  # Anthropic's: its tool_use input an object
    assert r.status_code == 200 and r.json()["stop_reason"] == "max_tokens", r.text
    assert [(b["type"], b["name"], b["input"]) for b in r.json()["content"]] == [("tool_use", "get_time", {})]


@pytest.mark.parametrize("text,want", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', ("get_weather", '{"city": "Par')),
    ('{"name": "get_weather", "parameters": {"ci', ("get_weather", '{"ci')),                 # Llama 3
    ('[TOOL_CALLS]get_weather[ARGS]{"ci', ("get_weather", '{"ci')),                         # Mistral [ARGS]
    ('[TOOL_CALLS][{"name": "get_time", "arguments": {"t', ("get_time", '{"t')),            # Mistral's list
    (' to=functions.get_weather<|channel|>commentary json<|message|>{"c', ("get_weather", '{"c')),  # gpt-oss
    ('<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>x',
     ("get_weather", '{"city": "Paris"}')),                                                 # GLM: whole pairs
    ('{"tool_call": {"name": "get_time", "arguments": {"tz": [', ("get_time", '{"tz": [')),  # generic
    ('<tool_call>\n{"name": "get_weather", "argu', ("get_weather", "")),
    ('<tool_call>\n{"na', None),
])
def test_cut_call_reads_each_form(text, want):
    """``tool_calls.cut_call`` on each form's opening cut mid-way: the tool's name once it came whole, the
    arguments from their first bracket on."""
    assert TC.cut_call(text, ["get_weather", "get_time"], {}) == want


NATIVE = ["GLM-4.6", "llama-cpp-deepseek-r1", "moonshotai-Kimi-K2", "openai-gpt-oss-120b"]


@pytest.mark.parametrize("name", NATIVE)
def test_native_calls_round_trip_through_real_templates(eng, monkeypatch, name):
    """A call as each family's real chat template writes it in the history (the text after the generation
    prompt) is parsed back into the same call (name, arguments, GLM's string value kept as text), and the forced
    call's grammar (after the form's opening) accepts exactly that text: what coli forces is what the model was
    trained to write."""
    import llguidance

    from coli import constrain
    from coli.server_params import chat_messages

    tok = eng.tokenizer
    monkeypatch.setattr(tok, "chat_template", _fixture_template(name))
    fmt = TC.template_format(tok.chat_template)
    args = {"city": "42"}  # a string that reads as JSON: GLM's schema-typed value keeps it a string
    msgs = chat_messages({"messages": TQ + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps(args)}}]}]})
    prompt = tok.apply_chat_template(msgs[:-1], True, tools=WEATHER_TOOLS)
    full = tok.apply_chat_template(msgs, False, tools=WEATHER_TOOLS)
    k = next(i for i, (a, b) in enumerate(zip(prompt + "\0", full)) if a != b)
    k -= full[k - 1] == "<"  # DeepSeek-R1's prompt opens <think> where its history writes the call
    written = full[k:]
    tools = TC.request_tools({"tools": WEATHER_TOOLS, "tool_choice": "required"})
    think = TC.think_mode(tok.chat_template, prompt[-16:])
    if think == "open":  # the model closes the span its prompt opened (the history drops the reasoning)
        written = TC.THINK_CLOSE + "\n\n" + written
    msg, reason = TC.Finisher(tools, "", think, fmt)(0, written, type("R", (), {"finish_reason": "stop"})())
    assert reason == "tool_calls" and not msg["content"], (written, msg)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
        [("get_weather", args)]
    opening = constrain.NATIVE_OPENINGS[fmt]
    body = written[written.index(opening) + len(opening):]
    g = llguidance.LLMatcher.grammar_from_lark(constrain.native_call(tok, tools, fmt))
    m = llguidance.LLMatcher(constrain.lltokenizer(tok), g, log_level=0)
    for end in ("<｜end▁of▁sentence｜>", "<|im_end|>"):  # the turn's end follows the call: not the grammar's
        body = body.removesuffix(end)
    for t in tok.encode(body, add_bos=False):
        assert m.consume_token(t), (body, m.get_error())
    assert m.is_accepting(), body


def test_lark_literal_names_special_tokens(eng):
    """Text that holds a special token of the tokenizer is written to the grammar with the token's id (only that
    token matches it: llguidance never matches a special token's text with a string), the rest quoted."""
    from coli import constrain

    tok = eng.tokenizer
    (im,) = tok.encode("<|im_start|>", add_bos=False)
    assert constrain.lark_literal(tok, "a<|im_start|>b") == f'"a" <[{im}]> "b"'
    assert constrain.lark_literal(tok, "[ARGS]") == '"[ARGS]"'  # not a special token of SmolLM2


def test_generic_form_parse_and_schema():
    """llama.cpp's generic form: ``{"tool_calls": [...]}`` (parallel), ``{"tool_call": {...}}`` (not parallel)
    and ``{"response": TEXT}`` read back; the forced schema takes the parallel form's list (at least one call)
    or the single call."""
    from coli import constrain

    assert TC.parse_generic('{"tool_calls": [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]}') \
        == ("", [("f", '{"a": 1}'), ("g", "{}")])
    assert TC.parse_generic('{"tool_call": {"name": "f", "arguments": {}}}') == ("", [("f", "{}")])
    assert TC.parse_generic('{"response": "Hi."}') == ("Hi.", [])
    assert TC.parse_generic("Hi {") == ("Hi {", [])
    t = TC.request_tools({"tools": WEATHER_TOOLS, "tool_choice": "required"})
    s = constrain.generic_call_schema(t)
    assert s["required"] == ["tool_calls"] and s["properties"]["tool_calls"]["minItems"] == 1
    t = TC.request_tools({"tools": WEATHER_TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    assert constrain.generic_call_schema(t)["required"] == ["tool_call"]


def test_kv_unified_server(eng):
    """``create_app(kv_unified=True)`` (``coli serve --kv-unified``, the default's paged cells): /health says the
    slots share the context's cells and how many the slots hold (the blocks of what the request wrote), and a
    request answers the library's greedy text."""
    from coli.kv_blocks import BLOCK as PAGE

    with _client(eng, parallel=2, kv_unified=True) as c:
        h = c.get("/health").json()
        assert h["kv_unified"] is True and h["kv_cells"] == CTX and h["kv_cells_held"] == 0
        ids = eng.tokenizer.encode_chat(Q)
        r = c.post("/v1/chat/completions", json={"messages": Q, "max_tokens": 6, "temperature": 0}).json()
        assert r["choices"][0]["message"]["content"] == _greedy(eng, ids, 6).text
        h = c.get("/health").json()
        assert h["kv_cells_held"] == -(-(len(ids) + 6) // PAGE) * PAGE and h["waiting_for_kv"] == 0


# ------------------------------------------------------------------------------------- /tokenize, /detokenize

def test_tokenize_detokenize_as_llama_server(http, eng):
    """llama-server's ``/tokenize`` and ``/detokenize``: the ids are llama.cpp's ``llama_tokenize`` ids of the same
    texts (recorded in fixtures/tokenizer/llama_cpp.json; ``add_special`` false, then the file's BOS rule),
    pieces are each token's bytes (text, or a list of ints where they are not whole UTF-8) and join to the
    content, and ``/detokenize`` gives the content back."""
    from conftest import FIXTURES

    rec = json.loads((FIXTURES / "tokenizer" / "llama_cpp.json").read_text())
    want = rec["models"]["smollm2"]
    for text, ids, ids_default in zip(rec["texts"], want["ids"], want["ids_default"]):
        r = http.post("/tokenize", json={"content": text})
        assert r.status_code == 200 and r.json() == {"tokens": ids}, text
        assert http.post("/tokenize", json={"content": text, "add_special": True}).json()["tokens"] == ids_default
        assert http.post("/detokenize", json={"tokens": ids}).json() == {"content": text}
    text = "unicode 媽 and emoji 🤗 <|im_start|>"
    ids = http.post("/tokenize", json={"content": text}).json()["tokens"]
    assert ids[-1] == eng.tokenizer.tokens.index("<|im_start|>")   # a special token's text read as the token
    pieces = http.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    assert any(isinstance(p["piece"], list) for p in pieces)   # the emoji's bytes are split across tokens
    joined = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces)
    assert joined == text.encode()
    assert http.post("/detokenize", json={"tokens": ids}).json()["content"] == text


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "content"), ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "a", "with_pieces": "yes"}, "with_pieces"),
    ("/tokenize", {"content": "a", "parse_special": False}, "parse_special"),
    ("/detokenize", {"tokens": [1, "a"]}, "tokens"), ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens")])
def test_tokenize_detokenize_bad_fields_are_400(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_prompt_steps_are_short_with_several_slots(eng):
    """With --parallel > 1 a prompt step takes at most SHARED_PROMPT_ROWS rows (a request arriving mid-prompt
    waits for one such step, not a whole COLI_UBATCH one); one slot keeps the engine's prompt step."""
    from coli.server_worker import SHARED_PROMPT_ROWS

    for parallel, want in ((1, eng.prompt_chunk()), (2, min(eng.prompt_chunk(), SHARED_PROMPT_ROWS))):
        with _client(eng, parallel=parallel) as c:
            assert c.app.state.coli["worker"].batcher.chunk == want
    assert eng.prompt_chunk() > SHARED_PROMPT_ROWS   # the default COLI_UBATCH (256): the cap is in effect

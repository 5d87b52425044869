"""llama.cpp's token ids for every pre-tokenizer type, for tests/fixtures/tokenizer/pretokenizers.json.

    python scripts/pretokenizer_oracle.py vocab OUT.gguf          # here: Qwen2.5's vocabulary, no tensors
    python3 scripts/pretokenizer_oracle.py run VOCAB.gguf LLAMA_TOKENIZE OUT.json   # stdlib only

``vocab`` writes Qwen2.5-Coder-0.5B's metadata (a byte-level BPE of 151k tokens that covers CJK, Korean, emoji)
with no tensors. ``run`` writes one copy per pre type with ``tokenizer.ggml.pre`` changed (the rest of the file
byte for byte) and records ``llama-tokenize -m COPY -f TEXT --ids --no-bos --no-escape --log-disable`` for each
text (parse_special on, as llama-cli) with the ids coli's own tokenizer of the same file must give. What differs
between the types is the split regexes (and ``ignore_merges``), so one vocabulary shows them all.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tempfile

TEXTS = [
    "Hello World! It's 1234567 and 3.14159, don'T WE'LL 2024-06-01 1,000,000",
    "def f(x):\n\tif x > 0:  # square\n\t\treturn x ** 2\r\n    return -x  \n\n\n   indented",
    "日本語の文章です。中文，你好世界！한국어 텍스트 ひらがなカタカナ 漢字123",
    "emoji 👋🏽 🚀 and 👨‍👩‍👧‍👦 family 😀😂 ©®™ ½ ①②",
    "français, Zürich, naïve café, ÉCOLE NORMALE, São Paulo, Ærøskøbing, ΑΒΓ αβγ, Москва, मराठी, العربية",
    "   leading and trailing   \u00a0nbsp\u2009thin\u3000ideographic \u200bzero width ~`!@#$%^&*()_+-={}[]|\\:;\"'<>,.?/",
    "MixedCase camelCaseWord HTTPServer iPhone x86_64 GPT-4o 中文English混合text123中",
]
PRES = ["default", "minicpm5", "llama-bpe", "deepseek-llm", "deepseek-coder", "deepseek-v3", "spark2_5", "youtu",
        "falcon", "gpt-2", "starcoder", "jais-2", "qwen2", "qwen35", "dbrx", "bloom", "chatglm-bpe", "glm4",
        "viking", "tekken", "chameleon", "gpt-4o", "granite-embed-multi-97m", "tiny_aya", "superbpe", "bailingmoe",
        "seed-coder", "kimi-k2", "ufakzeka", "grok-2", "afmoe", "laguna", "exaone-moe"]


def make_vocab(out: str) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from gguf_split import _kv

    from coli.fetch import model_path
    from coli.gguf_file import open_gguf

    g = open_gguf(model_path("qwen25", quiet=True))
    kvs = [_kv(k, g.meta[k], g.kv_types[k]) for k in g.meta]
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs)
    with open(out, "wb") as f:
        f.write(head + b"\0" * (-len(head) % 32))


def with_pre(data: bytes, pre: str) -> bytes:
    """``data`` (a tensor-less GGUF) with the string value of ``tokenizer.ggml.pre`` replaced."""
    key = b"tokenizer.ggml.pre"
    i = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<I", data, i)[0] == 8  # a string
    n = struct.unpack_from("<Q", data, i + 4)[0]
    v = pre.encode()
    body = data[:i + 4] + struct.pack("<Q", len(v)) + v + data[i + 12 + n:]  # the old padding stays: no tensors follow
    return body + b"\0" * (-len(body) % 32)


def run(vocab: str, tool: str, out: str) -> None:
    data = open(vocab, "rb").read()
    res = {"llama_cpp": "llama-cpp-python 0.3.36's vendored llama.cpp, tools/tokenize (llama-tokenize)",
           "vocab": "Qwen2.5-Coder-0.5B-Instruct q4_k_m's tokenizer.* metadata, tokenizer.ggml.pre replaced",
           "command": "llama-tokenize -m VOCAB -f TEXT --ids --no-bos --no-escape --log-disable",
           "texts": TEXTS, "ids": {}}
    with tempfile.TemporaryDirectory() as d:
        for k, t in enumerate(TEXTS):
            open(os.path.join(d, f"t{k}.txt"), "w", encoding="utf-8").write(t)
        for pre in PRES:
            p = os.path.join(d, "v.gguf")
            open(p, "wb").write(with_pre(data, pre))
            ids = []
            for k in range(len(TEXTS)):
                r = subprocess.run([tool, "-m", p, "-f", os.path.join(d, f"t{k}.txt"), "--ids", "--no-bos",
                                    "--no-escape", "--log-disable"], capture_output=True, text=True, timeout=120)
                if r.returncode:
                    raise SystemExit(f"{pre}: {r.stderr[-400:]}")
                ids.append(json.loads(r.stdout.strip().splitlines()[-1]))
            res["ids"][pre] = ids
            print(pre, [len(x) for x in ids], flush=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(res, f, ensure_ascii=False, indent=None, separators=(",", ":"))


if __name__ == "__main__":
    if sys.argv[1] == "vocab":
        make_vocab(sys.argv[2])
    else:
        run(*sys.argv[2:5])

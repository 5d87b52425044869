"""``coli run | chat | serve | models | perplexity | info | bench | plan | tune`` (argparse), one function per
command.

``coli run`` keeps llama.cpp's ``llama-cli`` habits: ``-p``/``-f``/stdin prompts, ``-n -1``, ``--seed -1``,
``--stop``, ``--repeat-penalty``, ``--min-p``, ``--no-display-prompt``, ``-q``. ``-m`` takes a GGUF path or
a name coli can fetch (``coli models``).

User errors (``ColiError``) print one line ``coli: <message>`` on stderr and exit with code 2. Ctrl-C exits 130
and SIGTERM 143, both after the stats line and the routing history's save (``coli serve``, stopped so once it
serves: 0, as llama-server); a closed or broken stdout ends
the run quietly (exit 0).

Each command imports what it runs inside its function (the engine with Numba and the kernels, the server, the
tuner, the GGUF reader): ``coli --help`` and a flag's error line come without loading them.
"""
from __future__ import annotations

import argparse
import codecs
import functools
import json
import os
import secrets
import signal
import sys
import time
from pathlib import Path

from coli.base import settings
from coli.base.memory import mem_flag
from coli.base.errors import ColiError
from coli.base.paths import cached_file, user_path
from coli.base.progress import HoldFirst, bar, quiet as quiet_compiles, stderr_is_terminal, text_on_line
from coli.fetch import MODEL_NAMES, MODELS, check_folder  # MODEL_NAMES: the names -m takes besides a path
from coli.llama_flags import add_llama_flags, process_escapes, read_file_arg
from coli.resolve import resolve
from coli.vulkan import device_flag
from scheduler.trace import CATEGORIES, summarize


class _KeepFlag(argparse.Action):
    """Store the value and, in ``<dest>_flag``, the option string the user typed (``-ngl`` or ``--gpu-layers``), so
    that an error names the flag as given."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, self.dest + "_flag", option_string)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: X)`` after each option's help, unless the default is None/False or the help says it."""

    def _get_help_string(self, action):
        if (action.default is None or action.default is False or action.default == argparse.SUPPRESS
                or "default" in (action.help or "")
                or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))):
            return action.help
        return super()._get_help_string(action)


def resolve_model(name, quiet=False):
    """A ``-m`` value as a path: a known name (fetched or built on first use) or an existing file
    (``coli.resolve.resolve``)."""
    if name is None:
        return None

    return resolve(name, quiet=quiet)


def _engine_args(p: argparse.ArgumentParser, model_required=False):
    p.add_argument("-m", "--model", required=model_required,
                   help="GGUF file, Hugging Face folder (config.json, *.safetensors, tokenizer.json), or a model "
                        "name (smollm2, gemma3-270m, qwen2.5-coder-0.5b, demo: coli models); "
                        "default: the demo MoE, built on first use")
    p.add_argument("-t", "--threads", type=_threads, default=None,
                   help="CPU threads (default, and 0 or negative as llama.cpp: physical cores available)")
    p.add_argument("--ctx", "-c", "--ctx-size", type=int, default=None,
                   help="KV cache positions (default: the model's trained context, capped so the KV cache "
                        "takes at most a quarter of what the memory budget leaves; 0: the trained context, as "
                        "llama.cpp's -c 0)")
    p.add_argument("--expert-cache", type=int, default=None, metavar="N",
                   help="RAM expert cache slots per MoE layer (default: all experts if they fit the memory budget, "
                        "else what fits)")
    p.add_argument("--mem", type=float, default=None, metavar="GiB",
                   help="memory the run may use in all (COLI_MEM; default: the smallest of the cgroup's limit and "
                        "the RAM available less 15%% of the machine's RAM left to the rest of it)")
    p.add_argument("--usage", default=None, type=user_path, metavar="PATH", help="routing history file (default .coli_usage beside the model)")
    p.add_argument("--cpu-act", choices=["f32", "int8"], default=None,
                   help="activations of the CPU matmuls: f32, or int8 per 32 as llama.cpp (default: measured, see docs)")
    p.add_argument("--io-threads", type=int, default=None, help="background expert readers, 1 to 64 (default 4)")
    p.add_argument("--device", default=None, metavar="cpu|vulkan|vulkan:N",
                   help="vulkan: experts on the GPU tier of the best device, vulkan:N on device N (also "
                        "COLI_VULKAN=1, COLI_VK_DEV=N); default cpu")
    p.add_argument("--balance", dest="balance", action="store_true", default=None,
                   help="open the best Vulkan device with the tier and the measured-time balancer; with "
                        "--gpu-layers, it moves the resident experts' rows of a layer to the CPU by measured times")
    p.add_argument("--no-balance", dest="balance", action="store_false",
                   help="open the best Vulkan device with the tier, without the balancer")
    p.add_argument("--tier-gb", type=float, default=None, metavar="GB",
                   help="device memory for resident experts in GiB (COLI_VK_TIER_GB; default: the budget rule, "
                        "docs/tier.md)")
    p.add_argument("--gpu-layers", "-ngl", "--n-gpu-layers", type=int, default=None, metavar="N",
                   help="run the last N decoder layers whole on the device, one submit a token (-1: as many as the "
                        "budget holds; 0: none, the CPU alone, or the expert tier with --device vulkan; COLI_VK_LAYERS; "
                        "docs/vulkan.md \"Device layers\")")
    p.add_argument("--cpu-moe", "-cmoe", action="store_true",
                   help="device layers keep every routed expert on the CPU (RAM), joined mid-layer; alone: every layer "
                        "that fits on the device (COLI_VK_CPU_MOE=-1; docs/vulkan.md \"Experts on the CPU\")")
    p.add_argument("--n-cpu-moe", "-ncmoe", type=int, default=None, metavar="N",
                   help="the routed experts of the model's first N layers stay on the CPU (COLI_VK_CPU_MOE=N)")
    p.add_argument("--reproducible", action="store_true",
                   help="the same device expert set, hence the same logits bytes, every run: uploads waited for, "
                        "no balancer (COLI_VK_TIER_SYNC=1 with --no-balance)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a token's logits bit-identical however its prompt was chunked for every matrix, also those "
                        "without t16 tiles (COLI_BATCH_INVARIANT=1; docs/engine.md \"Batch invariance\")")
    p.add_argument("--cache-type-k", "-ctk", default=None, metavar="TYPE",
                   help="KV cache type of K: f32, f16, bf16 or q8_0 (COLI_CACHE_TYPE_K; default f32; device layers "
                        "(--gpu-layers) take each; docs/engine.md \"KV cache types\")")
    p.add_argument("--cache-type-v", "-ctv", default=None, metavar="TYPE",
                   help="KV cache type of V, as --cache-type-k (COLI_CACHE_TYPE_V)")
    p.add_argument("--ubatch-size", "-ub", type=int, default=None, metavar="N",
                   help="rows of a prompt step (COLI_UBATCH, llama.cpp's n_ubatch; default 256 on the CPU; with "
                        "--gpu-layers the device's chunk too, else 2048 or 512: COLI_VK_PROMPT_ROWS)")
    p.add_argument("--batch-size", "-b", type=int, default=None, metavar="N",
                   help="llama.cpp's logical batch: a prompt step is at most N rows (the CPU step is the smaller of "
                        "-b and -ub, as llama.cpp's n_ubatch = min(n_batch, n_ubatch)); coli has no other batch")
    p.add_argument("--trace", default=None, type=user_path, metavar="FILE.json", help="write Chrome/Perfetto trace events")


def _open_engine(a, quiet=False, save_usage=True, ctx_name=None):
    from coli.engine import Engine  # loads Numba: only when a command opens a model, not for --help

    device, index = device_flag(a.device)
    tier_flags = [f for f, on in (("--balance", a.balance is True), ("--no-balance", a.balance is False),
                                  ("--reproducible", a.reproducible), ("--tier-gb", a.tier_gb is not None)) if on]
    asked = f"--device {a.device}" if a.device else None   # what opened the device, for its errors
    if device is None and (tier_flags or settings.get("COLI_VULKAN")):
        device = "vulkan"   # the tier's flags open the best Vulkan device, as --device vulkan does
        asked = tier_flags[0] if tier_flags else "COLI_VULKAN=1"
    if tier_flags and device == "cpu":
        raise ColiError(f"{tier_flags[0]} needs the device: drop --device cpu")
    if a.reproducible and a.balance:
        raise ColiError("--reproducible runs without the balancer: drop --balance")
    if a.tier_gb is not None and not a.tier_gb >= 0:
        raise ColiError(f"--tier-gb: {a.tier_gb} (GiB, 0 or above)")
    if a.ubatch_size is not None and a.ubatch_size < 1:
        raise ColiError(f"--ubatch-size: {a.ubatch_size} (rows of a prompt step, 1 or more)")
    ubatch = a.ubatch_size
    if a.batch_size is not None:   # llama-context.cpp: n_ubatch = min(n_batch, n_ubatch)
        if a.batch_size < 1:
            raise ColiError(f"--batch-size: {a.batch_size} (the most rows of a prompt step, 1 or more)")
        step = settings.get("COLI_UBATCH")
        if ubatch is not None or a.batch_size < step:   # -b at or above the step changes nothing: the device's
            ubatch = min(a.batch_size, ubatch if ubatch is not None else step)   # chunk rule stays its own
    for side in "kv":   # a KV cache type's name at once, not after a first run's compiles
        if getattr(a, f"cache_type_{side}", None) is not None:
            from coli.runtime import check_kv_type

            check_kv_type(getattr(a, f"cache_type_{side}"), f"--cache-type-{side}")
    if a.gpu_layers is not None and a.gpu_layers < -1:
        raise ColiError(f"--gpu-layers: {a.gpu_layers} (a layer count, -1 for as many as fit, 0 for the expert tier)")
    cpu_moe = getattr(a, "n_cpu_moe", None)
    if cpu_moe is not None and cpu_moe < 0:
        raise ColiError(f"--n-cpu-moe: {cpu_moe} (layers whose experts stay on the CPU, 0 or more)")
    if getattr(a, "cpu_moe", False):
        if cpu_moe is not None:
            raise ColiError("--cpu-moe and --n-cpu-moe: one of them (--cpu-moe is every layer)")
        cpu_moe = -1
    if cpu_moe and a.gpu_layers == 0:
        raise ColiError("--n-cpu-moe/--cpu-moe with --gpu-layers 0: they place the experts of device layers")
    if cpu_moe and device == "cpu":
        raise ColiError("--n-cpu-moe/--cpu-moe needs the device: drop --device cpu")
    if device is None and cpu_moe:
        device = "vulkan"
        asked = "--cpu-moe" if cpu_moe < 0 else f"--n-cpu-moe {cpu_moe}"
    # coli bench's -ngl list names the value and the list it came from, as the user typed them: "-ngl 2 (of 1,2)"
    ngl = getattr(a, "gpu_layers_name", None) or f"--gpu-layers {a.gpu_layers}"
    if device is None and (a.gpu_layers or (a.gpu_layers is None and settings.get("COLI_VK_LAYERS"))):
        device = "vulkan"   # --gpu-layers N (or COLI_VK_LAYERS=N) opens the device, as the tier's flags do
        asked = ngl if a.gpu_layers else f"COLI_VK_LAYERS={settings.get('COLI_VK_LAYERS')}"
    if a.gpu_layers and device == "cpu":
        raise ColiError(f"{ngl} needs the device: drop --device cpu")
    if (a.gpu_layers or cpu_moe) and a.reproducible:
        raise ColiError(f"{ngl if a.gpu_layers else '--n-cpu-moe/--cpu-moe'} and --reproducible: --reproducible is "
                        f"the expert tier's; device layers run without it (drop one)")
    env = settings.overlay(None, COLI_VK_DEV=index, COLI_VK_TIER_GB=a.tier_gb, COLI_VK_LAYERS=a.gpu_layers,
                           COLI_VK_CPU_MOE=cpu_moe, COLI_UBATCH=ubatch,
                           COLI_VK_TIER_SYNC=True if a.reproducible else None, COLI_MEM=mem_flag(a),
                           COLI_BATCH_INVARIANT=True if a.batch_invariant else None)
    if getattr(a, "quiet", False):
        quiet_compiles()  # -q: stdout and errors only, the kernels' compile notice too
    model = resolve_model(a.model, quiet=quiet)
    return Engine(model, threads=a.threads, ctx=a.ctx, expert_cache=a.expert_cache, usage=a.usage,
                  cpu_act=a.cpu_act, io_threads=4 if a.io_threads is None else a.io_threads, device=device,
                  balance=False if a.reproducible else a.balance,
                  trace=a.trace, quiet=quiet, save_usage=save_usage, env=env,
                  cli_names={**({"vulkan": asked} if asked else {}), **({"ctx": ctx_name} if ctx_name else {})} or True,
                  silent=bool(getattr(a, "quiet", False)), cache_type_k=getattr(a, "cache_type_k", None),
                  cache_type_v=getattr(a, "cache_type_v", None))


BOM = "\ufeff"   # U+FEFF at the start of a text file: the UTF-8 byte order mark


def _read_prompt(a) -> str:
    """The prompt of ``coli run``: positional, ``-p TEXT``, ``-f FILE``, ``-p -`` (stdin) or a pipe. A UTF-8 byte
    order mark opening a file or the pipe (Windows editors write one) is an encoding mark, not text: dropped."""
    given = [(n, v) for n, v in (("PROMPT", a.prompt_pos), ("-p", a.prompt), ("-f", a.file)) if v is not None]
    if len(given) > 1:
        raise ColiError(f"prompt: given twice ({' and '.join(n for n, _ in given)}); give one")
    if a.file is not None:
        prompt = read_file_arg(a.file, f"-f {a.file}").removeprefix(BOM)   # less one trailing newline, as llama-cli
        if prompt == "":  # said before the model (or a device: --cpu-moe, --gpu-layers) is opened
            raise ColiError(f"-f {a.file}: empty (no prompt in it)")
        return _escaped(a, prompt, f"-f {a.file}")
    prompt = a.prompt if a.prompt is not None else a.prompt_pos
    if prompt == "-" or (prompt is None and not sys.stdin.isatty()):
        try:   # the bytes, decoded strictly: a C locale's stdin passes bad bytes on as lone surrogates
            buf = getattr(sys.stdin, "buffer", None)
            prompt = (buf.read().decode("utf-8") if buf is not None else sys.stdin.read()).removeprefix(BOM)
        except UnicodeDecodeError as e:
            raise ColiError(f"stdin: not UTF-8 text (byte {e.start})") from None
    if prompt is None or prompt == "":
        raise ColiError("prompt: empty (give a prompt: coli run \"Once upon a time\", -p TEXT, -f FILE or a pipe)")
    return _escaped(a, prompt, "-p" if a.prompt not in (None, "-") else "the prompt")


def _escaped(a, text: str, name: str) -> str:
    """``text`` with llama-cli's escapes processed (``\\n``, ``\\t``, ``\\xNN``: ``process_escapes``) unless
    ``--no-escape``."""
    return process_escapes(text, name) if a.escape else text


def _escape_stops(a) -> None:
    """``a.stop`` escaped as llama-cli's reverse prompts are (unless ``--no-escape``; -sys is not, as llama-cli)."""
    a.stop = [_escaped(a, t, "--stop") for t in a.stop] if a.stop else a.stop


def _start_line(eng) -> str:
    """The engine line on stderr: model, experts, threads, context (and why it is capped), the memory budget."""
    a = eng.args
    s = (f"coli: {eng.path.name}: {a.arch}, {a.n_layers} layer{'s' if a.n_layers != 1 else ''}"
         + (f", {a.n_experts} experts top-{a.top_k}" if a.n_experts else "")
         + f", {eng.threads} thread{'s' if eng.threads != 1 else ''}, ctx {eng.ctx}")
    if eng.ctx < a.ctx_train:
        why = ("capped by the memory budget: the KV cache at most a quarter of what it leaves" if eng.ctx == eng.ctx_cap
               else "--ctx")
        s += f" of {a.ctx_train} trained ({why})"
    s += f", {eng.memory.describe()}"
    if getattr(eng, "cache", None) is not None:
        s += f", expert cache {eng.expert_slots} a layer"
    return s


def _cpu_line() -> str:
    """The second start line: whether AMX tile instructions run here (``cpu_kernels.amx.probe``, a child process)
    and which instructions the CPU int8 matmuls use."""
    from cpu_kernels.amx import probe  # these two load Numba: only for the start line of a run
    from cpu_kernels.vnni import HAVE_VNNI

    ok, line = probe()
    return f"coli: {line}; CPU int8 matmuls on {'AVX-512 VNNI' if HAVE_VNNI else 'no VNNI (f32 activations)'}"


def _apply_config(a) -> str:
    """Settings from ``coli tune --save``'s config file for those not given on the command line (threads,
    I/O threads, the threading layer); returns the start line's note naming the file ("" without one)."""
    from coli.tune import apply_layer, load_config  # NumPy and psutil: only with a tuned configuration

    cfg, path = load_config()
    if not cfg:
        return ""
    used = []
    if a.threads is None and "threads" in cfg:
        a.threads = cfg["threads"]
        used.append(f"threads {cfg['threads']}")
    if a.io_threads is None and "io_threads" in cfg:
        a.io_threads = cfg["io_threads"]
        used.append(f"I/O threads {cfg['io_threads']}")
    if "threading_layer" in cfg:
        apply_layer(cfg["threading_layer"])
        used.append(f"layer {cfg['threading_layer']}")
    return f" ({', '.join(used)} from {path})" if used else ""


def cmd_run(a) -> int:
    prompt = _read_prompt(a)
    _escape_stops(a)
    if a.seed < -1:
        raise ColiError(f"--seed: {a.seed} (-1 for random, or 0 and above)")
    seed = secrets.randbits(32) if a.seed == -1 else a.seed
    _check_sampling(a)
    cfg_note = _apply_config(a)
    eng = _open_engine(a, quiet=a.quiet)
    try:
        ids = eng.prompt_ids(prompt, chat=a.chat)
        n = eng.check_fits(len(ids), a.n, a.temp, a.top_k, a.top_p, min_p=a.min_p, repeat_penalty=a.repeat_penalty,
                           repeat_last_n=a.repeat_last_n)
        if not a.quiet:
            print(_start_line(eng) + f", {eng.activations()}" + cfg_note + (f", seed {seed}" if a.temp > 0 else ""),
                  file=sys.stderr)
            print(_cpu_line(), file=sys.stderr)

        def write(s):
            sys.stdout.write(s)
            sys.stdout.flush()

        # the echoed prompt and the first token wait while the first steps compile (a bar must not erase them)
        emit = HoldFirst(write, prompt if not a.chat and not a.no_display_prompt else "")
        try:
            r = eng.generate(ids=ids, max_tokens=n, temp=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                             repeat_penalty=a.repeat_penalty, repeat_last_n=a.repeat_last_n, seed=seed,
                             stop=eng.chat_stops(a.stop) if a.chat else a.stop, on_text=emit)
            emit.flush()
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the stats of what was generated, then main's exit code
            _flush_held(emit)
            _say("\n", sys.stdout)
            _say("coli: " + eng.stats_line(eng.last_stats) + "\n", sys.stderr)
            raise
        except ColiError:  # a damaged expert read mid-answer...: end the echoed text's line before main's error line
            _flush_held(emit)
            _say("\n", sys.stdout)
            raise
        sys.stdout.write("\n")
        text_on_line(False)
        if not a.quiet:
            print("coli: " + eng.stats_line(r.stats), file=sys.stderr)
    finally:
        _close(eng)
    return 0


def _flush_held(emit) -> None:
    """Write what a :class:`coli.base.progress.HoldFirst` still holds, to a stdout that may be gone."""
    try:
        emit.flush()
    except (OSError, ValueError):
        pass


def _temperature(v: str) -> float:
    """``--temp``: a number; below 0 read as 0 (greedy), as llama.cpp's ``common/arg.cpp`` clamps it."""
    try:
        t = float(v)
    except ValueError:
        t = float("nan")
    if t != t:
        raise argparse.ArgumentTypeError(f"{v!r} is not a number")
    return max(t, 0.0)


def _top_k(v: str) -> int:
    """``--top-k``: an integer; -1 read as 0 (off), as llama.cpp's top-k sampler skips k <= 0 and coli serve takes
    ``top_k: -1``; below -1 is left for the sampler's one-line error."""
    try:
        k = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r} is not an integer") from None
    return 0 if k == -1 else k


def _sampling_args(p, temp: float):
    p.add_argument("--temp", "--temperature", type=_temperature, default=temp, metavar="T",
                   help="temperature (0 = greedy; below 0 read as 0, as llama.cpp)")
    p.add_argument("--top-k", type=_top_k, default=40, help="sample among the K most likely (0 or -1 = all)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus: the smallest set with this probability")
    p.add_argument("--min-p", type=float, default=0.05, help="drop tokens below this share of the top one's probability")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="penalise repeated tokens (1 = off)")
    p.add_argument("--repeat-last-n", type=int, default=64,
                   help="tokens the penalty looks back over (0 = off, -1 = the context)")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop before TEXT (repeatable)")
    p.add_argument("-s", "--seed", type=int, default=-1, help="sampling seed; -1: random (printed)")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("coli")
    except Exception:  # noqa: BLE001  (not installed: the source tree's version)
        return "0.1.0"


def _check_sampling(a) -> None:
    """The sampling flags and ``-n`` checked before the model loads, whose first run compiles kernels for minutes:
    the line ``coli.sampling.SamplingParams.validated`` gives (``--top-p: 2 (in [0, 1]; 1 = off)``), at once; ``-n``
    below -1, or at or above a ``--ctx`` given (the prompt takes a position at least). ``-n`` past the model's own
    context is known once it is read (``Engine.check_fits``)."""
    from coli.generation import check_max_tokens
    from coli.sampling import SamplingParams

    SamplingParams(temp=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, repeat_penalty=a.repeat_penalty,
                   repeat_last_n=a.repeat_last_n).validated()
    n = check_max_tokens(a.n, "-n")
    if a.ctx and a.ctx > 0 and n >= a.ctx:
        raise ColiError(f"-n: {n} token{'s' if n != 1 else ''} to generate and the prompt exceed the context of {a.ctx} position{'s' if a.ctx != 1 else ''} (--ctx)")


def cmd_chat(a) -> int:
    from coli.chat import run_chat  # imports the engine (Numba): only for coli chat

    _escape_stops(a)
    if a.seed < -1:
        raise ColiError(f"--seed: {a.seed} (-1 for random, or 0 and above)")
    _check_sampling(a)
    cfg_note = _apply_config(a)
    eng = _open_engine(a, quiet=a.quiet)
    try:
        if not a.quiet:
            print(_start_line(eng) + cfg_note, file=sys.stderr)
            print(_cpu_line(), file=sys.stderr)
        return run_chat(eng, a)
    finally:
        _close(eng)


def _file_text(path, flag: str) -> str:
    """The UTF-8 text of the file a flag names (ColiError naming the flag and the file)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ColiError(f"{flag} {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ColiError(f"{flag} {path}: not UTF-8 text (byte {e.start})") from None


def cmd_serve(a) -> int:
    from coli.server import bind, serve  # Starlette and uvicorn: only for coli serve

    if not 0 <= a.port <= 65535:
        raise ColiError(f"--port: {a.port} (0 to 65535)")
    if a.queue < 1:
        raise ColiError(f"--queue: {a.queue} (at least 1)")
    if a.parallel is not None and a.parallel < 1:
        raise ColiError(f"--parallel: {a.parallel} (slots, at least 1)")
    if not a.body_limit > 0:
        raise ColiError(f"--body-limit: {a.body_limit} (MiB, above 0)")
    if not 0 < a.chat_truncate_max_keep <= 1:
        raise ColiError(f"--chat-truncate-max-keep: {a.chat_truncate_max_keep} (a fraction of --ctx: above 0, "
                        "at most 1)")
    key = a.api_key
    if a.api_key_file:
        key = _file_text(a.api_key_file, "--api-key-file").removeprefix(BOM).strip()
        if not key:
            raise ColiError(f"--api-key-file {a.api_key_file}: empty")
    key = key or settings.get("COLI_API_KEY")
    cfg_note = _apply_config(a)
    sock = bind(a.host, a.port)  # a port in use is an error before the model loads
    template = _file_text(a.chat_template_file, "--chat-template-file") if a.chat_template_file else None
    eng = _open_engine(a, quiet=a.quiet)
    if template is not None:
        try:
            eng.tokenizer.use_template(template, f"--chat-template-file {a.chat_template_file}")
        except ColiError:
            _close(eng)
            raise
    from coli.slots import auto_parallel, check_parallel  # imports the engine (Numba): only for coli serve

    try:
        if a.parallel is None:  # llama-server's auto: 4 slots sharing the context's positions (paged), where they can
            a.parallel, unified = auto_parallel(eng)
            a.kv_unified = a.kv_unified or unified
        check_parallel(eng, a.parallel, a.kv_unified)  # before listening: the slots' KV caches fit the memory budget
    except ColiError:
        _close(eng)
        raise
    eng.cli_names = False  # errors go to HTTP clients: name the request's fields, not coli's flags
    if not a.quiet:
        print(_start_line(eng) + cfg_note, file=sys.stderr)
        print(_cpu_line(), file=sys.stderr)
    aliases = {eng.path.name}
    if a.model:
        aliases.add(a.model)
    model_id = a.alias or eng.path.stem
    try:
        return serve(eng, model_id, host=a.host, port=a.port, aliases=aliases, max_queue=a.queue, quiet=a.quiet,
                     sock=sock, api_key=key, cors=a.cors, body_limit_mb=a.body_limit,
                     parallel=a.parallel, warmup=not a.no_warmup, reasoning_format=a.reasoning_format,
                     kv_unified=a.kv_unified, chat_truncate=a.chat_truncate_max_keep if a.chat_truncate else None)
    finally:
        _close(eng)  # already closed by the server's shutdown; idempotent


def cmd_models(a) -> int:
    from coli.demo import demo_file_name  # gguf and NumPy: only for coli models

    rows = []
    for name in ("smollm2", "gemma3-270m", "qwen2.5-coder-0.5b"):
        spec = MODELS[MODEL_NAMES[name]]
        rows.append((name, cached_file("models", spec["file"]), ", ".join(spec["wheels"][:1])
                     + (" ..." if len(spec["wheels"]) > 1 else "")))
    rows.append(("demo", cached_file("demo", demo_file_name()), "built from smollm2 (docs/demo_moe.md)"))
    print(f"{'name':<20} {'cached':<8} {'size':>9}  path  (source)")
    for name, path, src in rows:
        have = path.exists()
        size = f"{path.stat().st_size / 2**20:.0f} MiB" if have else "-"
        print(f"{name:<20} {'yes' if have else 'no':<8} {size:>9}  {path}  ({src})")
    print("coli run -m NAME fetches a model on first use; -m also takes any GGUF path")
    return 0


def cmd_perplexity(a) -> int:
    """llama-perplexity's convention (``Engine.perplexity``): chunks of ``--ctx`` tokens with BOS at each
    start where the model wants one, the second half of each scored; ``--all-tokens`` scores every token.
    Progress per chunk on stderr (``[i]ppl,`` with the running estimate, as llama-perplexity prints it);
    the result on stdout."""
    text = read_file_arg(a.file, a.file)   # less one trailing newline: llama-perplexity's -f is llama-cli's
    if a.max_tokens is not None and a.max_tokens < 2:
        raise ColiError(f"--max-tokens: {a.max_tokens} (at least 2)")
    if a.chunks == 0:
        raise ColiError("--chunks: 0 (a chunk count, or -1 for all)")
    if text == "":
        raise ColiError(f"{a.file}: empty (no text to score)")
    eng = _open_engine(a, quiet=True)
    try:
        ids = eng.tokenize(text)
        if a.max_tokens:
            ids = ids[: a.max_tokens]
        t0 = time.perf_counter()

        terminal = stderr_is_terminal()
        pb = None
        done = []

        def progress(i, n, ppl):
            nonlocal pb
            if terminal:  # a bar with the running estimate, then llama-perplexity's line
                if pb is None:  # made at the first chunk, when the count is known
                    pb = bar(total=n, desc="perplexity", unit=" chunks")
                pb.set_postfix_str(f"ppl {ppl:.4f}", refresh=False)
                pb.update(1)
                pb.refresh()  # every chunk drawn: tqdm's own rate limit would skip fast chunks
                done.append(f"[{i}]{ppl:.4f},")
                if i == n:
                    pb.close()
                    sys.stderr.write("".join(done) + "\n")
                return
            end = "\n" if i == n else ""
            sys.stderr.write(f"[{i}]{ppl:.4f}," + end)
            sys.stderr.flush()

        if not a.quiet:
            way = "every token" if a.all_tokens else "second half of each chunk, as llama-perplexity"
            print(f"coli: {eng.path.name}: {len(ids)} tokens, chunks of {eng.ctx} ({way})", file=sys.stderr)
        r = eng.perplexity(ids, all_tokens=a.all_tokens, on_chunk=None if a.quiet else progress,
                           max_chunks=a.chunks if a.chunks > 0 else None,
                           name=f"{a.file} (--max-tokens {a.max_tokens})" if a.max_tokens else a.file)
        dt = time.perf_counter() - t0
        print(f"{a.file}: {r.n} tokens scored in {r.chunks} chunk{'s' if r.chunks != 1 else ''} of {r.ctx}"
              f"{' (all tokens)' if r.all_tokens else ''}, NLL {r.nll:.4f} nats/token, "
              f"perplexity {r.ppl:.4f} +/- {r.ppl_err:.4f} ({len(ids) / dt:.1f} tok/s)")
    finally:
        _close(eng)
    return 0


def cmd_info(a) -> int:
    from coli.gguf_file import describe, open_gguf  # gguf and NumPy: only for coli info

    path = a.model_pos or a.model
    if path is not None and os.path.isdir(path):  # a Hugging Face folder, as coli reads it (coli/hf_folder.py)
        from coli.hf_folder import open_folder  # loads Numba: only for a folder

        check_folder(path)

        g = open_folder(path)
    else:
        g = open_gguf(resolve_model(path))
    print(describe(g))
    return 0


def cmd_bench(a) -> int:
    """``coli bench``: llama-bench's lists (-p, -n, -t), -r repetitions, -o md|json|csv|jsonl (coli/bench.py)."""
    from coli.bench import format_records, parse_int_list, run_bench  # the engine (Numba): only for coli bench

    if a.repetitions < 1:
        raise ColiError(f"-r: {a.repetitions} repetitions (at least 1)")
    pp = parse_int_list(a.n_prompt, "-p")
    tg = parse_int_list(a.n_gen, "-n")
    if not any(pp) and not any(tg):
        raise ColiError(f"-p {a.n_prompt} -n {a.n_gen}: token counts must be >= 0, not all 0")
    threads = parse_int_list(a.threads, "-t", minimum=1) if a.threads is not None else None
    raw_ngl = a.gpu_layers
    ngls = (parse_int_list(a.gpu_layers, getattr(a, "gpu_layers_flag", None) or "-ngl", minimum=-1)
            if a.gpu_layers is not None else [None])
    fmt = "json" if a.json else a.output
    a.threads = max(threads) if threads else None

    def progress(rec):
        if fmt == "md" and sys.stderr.isatty():
            print(f"coli bench: {rec['test']} at {rec['n_threads']} threads: {rec['avg_ts']:.2f} t/s",
                  file=sys.stderr)

    ctx_name = None
    if a.ctx is None:  # llama-bench's n_ctx (n_prompt + n_gen): the budget keeps no room for a KV cache no test uses
        a.ctx = max([*pp, *tg]) + 1
        ctx_name = f"-p {a.n_prompt} -n {a.n_gen} (a context of the longest test + 1; -c sets it)"
    recs = []
    flag = getattr(a, "gpu_layers_flag", None) or "-ngl"   # the spelling the user typed (_KeepFlag)
    for ngl in ngls:  # llama-bench's -ngl list: a model (here an engine) per value
        a.gpu_layers = ngl
        a.gpu_layers_name = f"{flag} {ngl}" + (f" (of {raw_ngl})" if len(ngls) > 1 else "")
        eng = _open_engine(a, quiet=True, save_usage=False, ctx_name=ctx_name)  # no routing history from a benchmark
        try:
            recs += run_bench(eng, n_prompt=pp, n_gen=tg, reps=a.repetitions, cold=a.cold,
                              threads=threads or [eng.threads], bandwidth=a.bandwidth, on_test=progress)
        finally:
            _close(eng)
    print(format_records(recs, fmt))
    return 0


def cmd_tune(a) -> int:
    from coli.tune import cmd_tune as tune  # NumPy and psutil: only for coli tune

    return tune(a)


def cmd_plan(a) -> int:
    from coli.plan import cmd_plan as plan  # the runtime (Numba): only for coli plan

    return plan(a)


def _read_trace(path: str) -> list:
    """The events of a ``--trace`` file: a JSON array of objects, each complete event (``"ph": "X"``) with numeric
    ``ts`` and ``dur``; one ColiError naming the file (and the event) for anything else."""
    what = "coli trace reads the JSON array of events coli run --trace FILE.json writes"
    try:
        raw = Path(path).read_bytes()
        if not raw.strip():
            raise ColiError(f"{path}: empty (no trace events); {what}")
        events = json.loads(raw)
    except OSError as e:
        raise ColiError(f"{path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ColiError(f"{path}: not JSON text (not UTF-8); {what}") from None
    except json.JSONDecodeError as e:
        raise ColiError(f"{path}: not JSON (line {e.lineno}, column {e.colno}); {what}") from None
    if not isinstance(events, list):
        raise ColiError(f"{path}: a JSON {type(events).__name__}, not an array of events; {what}")
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise ColiError(f"{path}: event {i}: a JSON {type(e).__name__}, not an object; {what}")
        if e.get("ph") == "X" and not all(isinstance(e.get(k), (int, float)) and not isinstance(e.get(k), bool)
                                          for k in ("ts", "dur")):
            raise ColiError(f"{path}: event {i}: a complete event (\"ph\": \"X\") needs numbers \"ts\" and "
                            f"\"dur\"")
    return events


def cmd_trace(a) -> int:
    """``coli trace FILE``: a ``--trace`` file's totals per category, the overlap of device and CPU time and the
    share of device time hidden behind the CPU (``scheduler.trace.summarize`` defines them)."""
    s = summarize(_read_trace(a.trace))
    if a.json:
        print(json.dumps(s, indent=1))
        return 0
    print(f"{'category':<10}{'events':>8}{'total ms':>12}{'busy ms':>12}")
    order = [c for c in CATEGORIES if c in s["categories"]] + sorted(set(s["categories"]) - set(CATEGORIES))
    for c in order:
        d = s["categories"][c]
        print(f"{c:<10}{d['count']:>8}{d['total_us'] / 1e3:>12.3f}{d['busy_us'] / 1e3:>12.3f}")
    print(f"device busy {s['device_us'] / 1e3:.3f} ms, CPU busy {s['cpu_us'] / 1e3:.3f} ms, "
          f"overlap {s['overlap_us'] / 1e3:.3f} ms, device time in joins {s['join_overlap_us'] / 1e3:.3f} ms")
    if s["hidden_pct"] is None:
        print("no device events: nothing to hide")
    else:
        print(f"{s['hidden_pct']:.1f}% of device time hidden behind CPU expert work")
    return 0


def _escape_args(p) -> None:
    """llama-cli's ``-e`` / ``--no-escape``: escapes in the prompt and --stop processed by default (common/arg.cpp)."""
    p.add_argument("-e", "--escape", dest="escape", action="store_true", default=True,
                   help="process escapes in the prompt (-p, -f's file, stdin) and --stop: \\n \\r \\t \\' \\\" "
                        "\\\\ \\xNN, as llama-cli (default)")
    p.add_argument("--no-escape", dest="escape", action="store_false", help="take the prompt and --stop as written")


def _run_parser(sub) -> None:
    """``coli run``'s flags."""
    r = sub.add_parser("run", help="generate text", formatter_class=_Help)
    r.add_argument("prompt_pos", nargs="?", default=None, metavar="PROMPT")
    r.add_argument("-p", "--prompt", default=None, help="the prompt; - reads it from stdin (as does a pipe)")
    r.add_argument("-f", "--file", default=None, type=user_path, help="read the prompt from FILE")
    _escape_args(r)
    r.add_argument("-n", "--n-predict", "--predict", dest="n", type=int, default=64,
                   help="tokens to generate; -1: until end of generation or the context is full")
    r.add_argument("--chat", "-st", "--single-turn", action="store_true",
                   help="wrap the prompt in the model's chat template")
    _sampling_args(r, temp=0.0)
    r.add_argument("--no-display-prompt", action="store_true", help="print only the generated text, not the prompt")
    r.add_argument("-q", "--quiet", action="store_true", help="stdout and errors only (no start and speed lines)")
    r.add_argument("--version", action="version", version=f"coli {_version()}")
    _engine_args(r)
    r.set_defaults(func=cmd_run)


def _chat_parser(sub) -> None:
    """``coli chat``'s flags."""
    c = sub.add_parser("chat", help="interactive chat in the terminal (/reset, /exit; Ctrl-C stops an answer, "
                       "at the prompt quits)",
                       formatter_class=_Help)
    c.add_argument("--system", "-sys", "--system-prompt", default=None, help="system message")
    _escape_args(c)
    c.add_argument("-n", "--n-predict", "--predict", dest="n", type=int, default=-1,
                   help="tokens per answer at most; -1: until end of generation or the context is full")
    _sampling_args(c, temp=0.8)
    c.add_argument("-q", "--quiet", action="store_true", help="no start and speed lines")
    _engine_args(c)
    c.set_defaults(func=cmd_chat)


def _serve_parser(sub) -> None:
    """``coli serve``'s flags."""
    s = sub.add_parser("serve", help="HTTP server: OpenAI's /v1/chat/completions and /v1/completions, Anthropic's "
                       "/v1/messages",
                       formatter_class=_Help)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8080, help="TCP port")
    s.add_argument("--queue", type=int, default=8, help="requests waiting at most (more get 503)")
    s.add_argument("-np", "--parallel", type=int, default=None, metavar="N",
                   help="slots: requests decoded together as one batch, each with its own KV cache of --ctx "
                        "(default: 4 sharing --ctx positions as with --kv-unified, llama-server's auto; 1 where the "
                        "caches cannot be paged or with --gpu-layers)")
    s.add_argument("-kvu", "--kv-unified", action="store_true",
                   help="the slots share --ctx positions in all, in blocks of 64 taken as a request grows and given "
                        "back when it ends (a request whose prompt does not fit waits) instead of --ctx each")
    s.add_argument("--alias", "-a", default=None, help="the served model's id (default: the file's stem)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="clients must send 'Authorization: Bearer KEY' (else COLI_API_KEY; none: no check)")
    s.add_argument("--api-key-file", default=None, type=user_path, metavar="FILE", help="read the key from FILE")
    s.add_argument("--cors", nargs="+", default=None, metavar="ORIGIN",
                   help="browser origins allowed to call the server ('*' for any; default: localhost's only)")
    s.add_argument("--body-limit", type=float, default=16, metavar="MiB", help="request bodies above it get 413")
    s.add_argument("--no-warmup", action="store_true",
                   help="skip the warm-up generation before the first request (it pays the kernels' compile; "
                        "/health answers 503 until it ends)")
    s.add_argument("--chat-template-file", default=None, type=user_path, metavar="FILE",
                   help="a Jinja chat template rendered instead of the model's tokenizer.chat_template (llama-server's)")
    s.add_argument("--chat-truncate", action=argparse.BooleanOptionalAction, default=True,
                   help="a conversation past --ctx has its oldest turns dropped, the system messages and the last "
                        "user turn kept (--no-chat-truncate: a 400 exceed_context_size_error, llama-server's default)")
    s.add_argument("--chat-truncate-max-keep", type=float, default=1.0, metavar="F",
                   help="once turns are dropped, the prompt keeps under F of --ctx (llama-server's; 1: until it fits)")
    s.add_argument("--reasoning-format", default="auto", choices=("auto", "deepseek", "none"),
                   help="a <think> span of the answer as reasoning_content / thinking blocks: auto (when the chat "
                        "template writes one), deepseek (always), none (left in the content)")
    s.add_argument("-q", "--quiet", action="store_true",
                   help="no start line, ready line or access log (the serving and warm-up lines stay)")
    _engine_args(s)
    s.set_defaults(func=cmd_serve)


def _models_parser(sub) -> None:
    """``coli models``'s flags."""
    m = sub.add_parser("models", help="the model names -m accepts and where they are cached", formatter_class=_Help)
    m.set_defaults(func=cmd_models)


def _perplexity_parser(sub) -> None:
    """``coli perplexity``'s flags."""
    q = sub.add_parser("perplexity", help="perplexity of a text file, as llama-perplexity computes it")
    q.add_argument("-f", "--file", required=True, type=user_path)
    q.add_argument("--max-tokens", type=int, default=None, metavar="N", help="score only the first N tokens")
    q.add_argument("--chunks", type=int, default=-1, metavar="N",
                   help="score at most N chunks of --ctx (-1: all), as llama-perplexity's --chunks")
    q.add_argument("--all-tokens", action="store_true",
                   help="score every token (default: the second half of each --ctx chunk, as llama-perplexity)")
    q.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    _engine_args(q)
    q.set_defaults(func=cmd_perplexity)


def _info_parser(sub) -> None:
    """``coli info``'s flags."""
    i = sub.add_parser("info", help="architecture, tensors, types, sizes, experts")
    i.add_argument("model_pos", nargs="?", metavar="MODEL")
    i.add_argument("-m", "--model", default=None,
                   help="GGUF file, Hugging Face folder or a model name (smollm2, gemma3-270m, qwen2.5-coder-0.5b, demo)")
    i.set_defaults(func=cmd_info)


def _bench_parser(sub) -> None:
    """``coli bench``'s flags."""
    b = sub.add_parser("bench", help="prefill ppN and decode tgN tok/s, llama-bench style", conflict_handler="resolve")
    b.add_argument("-p", "--n-prompt", default="128", help="prompt lengths: 128 or 64,512 or 0 (none)")
    b.add_argument("-n", "--n-gen", default="64", help="tokens generated: 64 or 16,64 or 0 (none)")
    b.add_argument("-r", "--repetitions", type=int, default=5)
    b.add_argument("-o", "--output", choices=["md", "json", "csv", "jsonl"], default="md",
                   help="md table, or records with llama-bench's field names plus coli's")
    b.add_argument("--json", action="store_true", help="same as -o json")
    b.add_argument("--bandwidth", action="store_true",
                   help="run a memory-read probe at each thread count; the table shows it beside the weight GB/s")
    b.add_argument("--cold", action="store_true", help="drop the model file's pages from the page cache before each run")
    _engine_args(b)
    b.add_argument("-t", "--threads", default=None, metavar="LIST",
                   help="Numba thread counts: 2, 1,2,4, 1-16, 1-16*2 (default: physical cores available)")
    b.add_argument("--gpu-layers", "-ngl", "--n-gpu-layers", dest="gpu_layers", default=None, metavar="LIST",
                   action=_KeepFlag,
                   help="device layers, a list as llama-bench's -ngl (1,2 or 0-8+4; -1: as many as fit): the model "
                        "is opened once per value; as coli run's --gpu-layers otherwise")
    b.set_defaults(func=cmd_bench)


def _plan_parser(sub) -> None:
    """``coli plan``'s flags."""
    pl = sub.add_parser("plan", help="what a model takes here (RAM, KV cache, expert cache, device, disk), before loading it")
    pl.add_argument("-m", "--model", default=None,
                    help="GGUF file or a model name (smollm2, gemma3-270m, qwen2.5-coder-0.5b, demo; default: demo)")
    pl.add_argument("--device", default=None, metavar="cpu|vulkan|vulkan:N",
                    help="vulkan: read the best device's heaps for the tier, vulkan:N device N's")
    pl.add_argument("--ctx", "-c", "--ctx-size", type=int, default=None,
                    help="KV cache positions (default: the trained context, capped by the memory budget as coli run's; "
                         "0: the trained context)")
    pl.add_argument("--expert-cache", type=int, default=None, metavar="N", help="RAM expert cache slots per MoE layer")
    pl.add_argument("--mem", type=float, default=None, metavar="GiB",
                    help="memory the run may use in all (COLI_MEM; default: the cgroup's limit or the RAM available "
                         "less 15%% of the machine's RAM)")
    pl.add_argument("--cache-type-k", "-ctk", default=None, metavar="TYPE",
                    help="KV cache type of K: f32, f16, bf16 or q8_0 (COLI_CACHE_TYPE_K; default f32)")
    pl.add_argument("--cache-type-v", "-ctv", default=None, metavar="TYPE",
                    help="KV cache type of V (COLI_CACHE_TYPE_V; default f32)")
    pl.add_argument("--json", action="store_true", help="the plan as JSON (bytes)")
    pl.set_defaults(func=cmd_plan)


def _trace_parser(sub) -> None:
    """``coli trace``'s flags."""
    tr = sub.add_parser("trace", help="summarise a --trace file: time per category, device time hidden behind the CPU")
    tr.add_argument("trace", type=user_path, metavar="FILE", help="a trace JSON file written by coli run --trace")
    tr.add_argument("--json", action="store_true", help="the summary as JSON")
    tr.set_defaults(func=cmd_trace)


def _tune_parser(sub) -> None:
    """``coli tune``'s flags."""
    tu = sub.add_parser("tune", help="sweep threads, I/O threads, threading layers (and the device): CSV, PNG, a recommendation")
    tu.add_argument("-m", "--model", default=None,
                    help="GGUF file or a model name (smollm2, gemma3-270m, qwen2.5-coder-0.5b, demo; default: demo)")
    tu.add_argument("--device", default=None, metavar="DEV",
                    help="cpu, vulkan or vulkan:N (as coli run takes it): a device also sweeps device on/off, balancer on/off")
    tu.add_argument("--out", default="coli-tune", type=user_path, metavar="DIR", help="folder for tune.csv and tune.png (default ./coli-tune)")
    tu.add_argument("--save", action="store_true", help="write the recommendation to ~/.config/coli/config.toml (coli run reads it)")
    tu.add_argument("--threads", default=None, metavar="LIST", help="Numba thread counts (default 1..physical cores, and the logical count)")
    tu.add_argument("--io-threads", default=None, metavar="LIST", help="I/O thread counts (default 1,4,8 when experts stream from disk, else 4)")
    tu.add_argument("--layers", default=None, metavar="LIST", help="threading layers: tbb,omp (default: each usable one)")
    tu.add_argument("--reps", type=int, default=3, help="runs a point (alternating)")
    tu.add_argument("-p", "--n-prompt", type=int, default=64, help="prompt tokens a run")
    tu.add_argument("-n", "--n-gen", type=int, default=16, help="decode tokens a run")
    tu.add_argument("--max-load", type=float, default=None, metavar="X",
                    help="no recommendation when the load average before the sweep is above X (default: half the CPUs)")
    tu.set_defaults(func=cmd_tune)


class _Parser(argparse.ArgumentParser):
    """coli's parser: an unknown option is argparse's error line with the command's closest option (difflib), as an
    unknown COLI_* variable's warning names the closest: ``unrecognized arguments: --thread (did you mean
    --threads?)``."""

    def parse_args(self, args=None, namespace=None):
        import difflib

        a, extra = self.parse_known_args(args, namespace)
        if extra:
            sub = self._subparsers._group_actions[0].choices.get(getattr(a, "cmd", None)) if self._subparsers else None
            names = [o for o, act in (sub or self)._option_string_actions.items() if act.help != argparse.SUPPRESS]
            said = []
            for x in extra:
                near = difflib.get_close_matches(x.split("=")[0], names, n=1) if x.startswith("-") else []
                said.append(f"{x} (did you mean {near[0]}?)" if near else x)
            self.error("unrecognized arguments: " + " ".join(said))
        return a


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: every long option spelled whole, as llama.cpp's (a prefix such as --thread is unknown, not
    # one of coli's or llama_flags' options it begins, nor "ambiguous" among them)
    p = _Parser(prog="coli", description="Mixture-of-Experts inference: CPU kernels, a device expert tier, experts "
                                         "streamed from disk", formatter_class=_Help, allow_abbrev=False,
                epilog="environment: " + ", ".join(v.name for v in settings.VARS if not v.dev)
                       + " (defaults and units: docs/settings.md)")
    p.add_argument("--version", action="version", version=f"coli {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=functools.partial(argparse.ArgumentParser,
                                                                                   allow_abbrev=False))
    _run_parser(sub)
    _chat_parser(sub)
    _serve_parser(sub)
    _models_parser(sub)
    _perplexity_parser(sub)
    _info_parser(sub)
    _bench_parser(sub)
    _plan_parser(sub)
    _trace_parser(sub)
    _tune_parser(sub)
    for name, sp in sub.choices.items():  # llama.cpp's flags, matched whole: refused in one line or taken as no-ops
        add_llama_flags(sp, name)
    for sp in (p, *sub.choices.values()):  # type=int / float: "1_0" refused (settings.plain_number), as COLI_* are
        for kind in (int, float):
            sp.register("type", kind, _plain(kind))
    return p


def _threads(s: str) -> int | None:
    """``-t N`` as llama.cpp reads it (common/arg.cpp: ``n_threads <= 0`` is the default): None for 0 or less."""
    n = _plain(int)(s)
    return n if n > 0 else None


_threads.__name__ = "int"   # argparse's line for a bad value names the type: "invalid int value: 'x'"


def _plain(kind):
    """``kind`` (int or float) as argparse's ``type=kind`` reads a flag's value, refusing what is not a
    :func:`settings.plain_number` with argparse's own line (``argument --mem: invalid float value: '1_0'``)."""
    def read(s: str):
        if not settings.plain_number(s):
            raise ValueError(s)
        return kind(s)
    return read



class Terminated(KeyboardInterrupt):
    """SIGTERM (docker stop, systemd): handled as Ctrl-C is, then exit code 143 (128 + 15)."""


_swallowed: list[int] = []  # signals whose exception a C callback swallowed (see _on_unraisable)
_resends: list = []  # a threading.Event per signal _on_unraisable sends again, set once it is sent


def _on_signal(signum, frame):
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _on_unraisable(hook):
    """A ``sys.unraisablehook`` that takes back an interrupt a C callback swallowed. Python runs a signal's handler
    at the next Python code, and while LLVM emits a kernel (Numba's compile or its cache load, seconds of C) that
    is often a ctypes callback (llvmlite's object-cache hooks): ctypes prints the KeyboardInterrupt as
    "Exception ignored" and goes on, so Ctrl-C was lost (a traceback, then the run went on to the end) and Numba's
    cache save then failed with "no compiled object yet" (a RuntimeError traceback). Here the interrupt is kept
    quiet and its signal sent again from another thread, to land in ordinary Python code; others go to ``hook``."""
    import _thread
    import threading

    def resend(sig, sent):
        time.sleep(0.01)  # sent at once it would land in this callback again
        os.kill(os.getpid(), sig)
        sent.set()

    def on_unraisable(u):
        if not isinstance(u.exc_value, KeyboardInterrupt):
            return hook(u)
        sig = signal.SIGTERM if isinstance(u.exc_value, Terminated) else signal.SIGINT
        _swallowed.append(sig)
        _resends.append(threading.Event())
        # threading's start() waits for the thread: the signal could land there
        _thread.start_new_thread(resend, (sig, _resends[-1]))

    return on_unraisable


def _interrupted(term: bool) -> int:
    """The line and exit code of an interrupted command (130 Ctrl-C, 143 SIGTERM); a signal still on its way
    (sent again by :func:`_on_unraisable`) or a second Ctrl-C is ignored from here, not a traceback at exit."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:
        pass
    _say(f"coli: {'terminated (SIGTERM)' if term else 'interrupted'}\n", sys.stderr)
    return 143 if term else 130


def _install_signals():
    """SIGTERM handled as Ctrl-C; SIGINT's handler kept unless it is Python's own (an ignored SIGINT, a
    background job's, stays ignored); interrupts swallowed by C callbacks taken back (:func:`_on_unraisable`).
    Returns what it replaced, for :func:`_restore_signals` (None: not the main thread, nothing replaced)."""
    try:
        old = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), sys.unraisablehook)
        signal.signal(signal.SIGTERM, _on_signal)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _on_signal)
    except ValueError:  # not the main thread (main() called from a library): leave signals alone
        return None
    if not getattr(sys.unraisablehook, "_coli", False):
        sys.unraisablehook = _on_unraisable(sys.unraisablehook)
        sys.unraisablehook._coli = True
    return old


def _restore_signals(old) -> None:
    """Give the caller of :func:`main` back its SIGINT and SIGTERM handlers and its ``sys.unraisablehook`` (``old``,
    from :func:`_install_signals`): after an interrupt they were left ignored, so the caller's own Ctrl-C did nothing.
    A signal :func:`_on_unraisable` is still sending lands while they are ignored, not in the caller's handler."""
    if old is None:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for sent in _resends:
        sent.wait(1.0)
    _resends.clear()
    signal.signal(signal.SIGINT, old[0] if old[0] is not None else signal.SIG_DFL)   # None: not set from Python
    signal.signal(signal.SIGTERM, old[1] if old[1] is not None else signal.SIG_DFL)
    sys.unraisablehook = old[2]


def _say(text: str, stream) -> None:
    """Write to a stream that may be closed or gone (no error: there is nowhere to report one)."""
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError, AttributeError):
        pass


def _close(eng) -> None:
    """``eng.close()`` (saves the routing history) with SIGINT and SIGTERM held back until it is done, so a
    second Ctrl-C or a repeated SIGTERM cannot cut the save short."""
    sigs = {signal.SIGINT, signal.SIGTERM}
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    except (AttributeError, OSError, ValueError):
        old = None
    try:
        eng.close()
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _ClosedStdout:
    """Stands for a closed stdout (``coli run ... >&-``: ``sys.stdout`` is None): writing raises
    BrokenPipeError, so the run ends as it does when the reader of a pipe goes away."""

    def write(self, s):
        raise BrokenPipeError(32, "stdout is closed")

    def flush(self):
        pass


def _devnull_stdout() -> None:
    """Point fd 1 at /dev/null so the interpreter's last flush does not fail again after a broken pipe."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, 1)
        os.close(fd)
    except OSError:
        pass


def _check_numba_threads() -> None:
    """``NUMBA_NUM_THREADS``, when set, is Numba's thread pool: a whole number >= 1, else one ColiError naming it
    (Numba raises a ValueError traceback at import for 0 or less, and ignores a word with a warning)."""
    v = os.environ.get("NUMBA_NUM_THREADS")
    if v and not (v.strip().isdigit() and int(v) >= 1):
        raise ColiError(f"NUMBA_NUM_THREADS={v!r}: Numba's thread pool, a whole number >= 1 (unset: one a core; "
                        f"--threads N uses fewer)")


def _utf8_out() -> None:
    """stdout and stderr write UTF-8 whatever the locale says (a Latin-1 terminal, ``PYTHONIOENCODING=ascii``), as
    llama-cli writes the model's bytes: the model's text is UTF-8, and another encoding raised UnicodeEncodeError
    at its first accented letter (a traceback mid-answer)."""
    for stream in (sys.stdout, sys.stderr):
        enc = getattr(stream, "encoding", None)
        try:
            if enc and codecs.lookup(enc).name != "utf-8" and hasattr(stream, "reconfigure"):
                stream.reconfigure(encoding="utf-8")
        except (LookupError, ValueError, OSError):  # an unknown codec, a stream that cannot change: left as is
            pass


def main(argv=None) -> int:
    """Run the command ``argv`` (``sys.argv[1:]`` when None) in this process; its exit code. The caller's SIGINT and
    SIGTERM handlers are its own again on return, interrupted or not (:func:`_restore_signals`)."""
    old = _install_signals()
    try:
        return _command(argv)
    finally:
        _restore_signals(old)


def console() -> None:
    """The ``coli`` command (pyproject's entry point; ``python -m coli``): :func:`main`'s work, then exit with its
    code. Here an interrupt leaves SIGINT and SIGTERM ignored up to the exit (:func:`_interrupted`): the process ends,
    and a second Ctrl-C or a signal still on its way is not a traceback at exit."""
    _install_signals()
    raise SystemExit(_command(None))


def _command(argv) -> int:
    """:func:`main` less the signals' setting up and giving back."""
    if sys.stdout is None:
        sys.stdout = _ClosedStdout()
    if sys.stderr is None:  # 2>&-: notes go nowhere rather than into stdout (print(file=None) means stdout)
        sys.stderr = open(os.devnull, "w")
    _utf8_out()
    _swallowed.clear()  # main() called again (a library, tests): an earlier call's interrupt was that call's
    p = build_parser()
    try:
        a = p.parse_args(argv)  # inside: a llama.cpp flag coli refuses is a ColiError (coli/llama_flags.py)
        if a.cmd == "info" and not (a.model_pos or a.model):
            p.error("info: give a MODEL")
        settings.check_all()  # a malformed COLI_* variable is one error before any work
        _check_numba_threads()
        return a.func(a)
    except ColiError as e:
        print(f"coli: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        return _interrupted(isinstance(e, Terminated))
    except BrokenPipeError:
        _devnull_stdout()
        return 0
    except Exception:
        if not _swallowed:
            raise
        # what an interrupt left broken before it was taken back (Numba: "no compiled object yet")
        return _interrupted(_swallowed[0] == signal.SIGTERM)


if __name__ == "__main__":
    console()

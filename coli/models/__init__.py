"""One module per architecture (GGUF ``general.architecture`` -> module)."""
from __future__ import annotations

import importlib

from coli.base.errors import ColiError

ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "gemma3": "gemma3",
    "qwen2moe": "qwen2moe",
    "qwen3moe": "qwen3moe",
    "olmoe": "olmoe",
    "qwen3next": "qwen3next",
    "qwen35moe": "qwen35moe",
    "gpt-oss": "gptoss",
    "mimo2": "mimo2",
    "deepseek2": "deepseek2",
    "glm-dsa": "glmdsa",
    "kimi-linear": "kimi",
    "deepseek4": "deepseek4",
}


def model_class_of(arch: str):
    """The ``Model`` class of GGUF architecture ``arch``; ColiError naming it when unsupported."""
    mod = ARCHITECTURES.get(arch)
    if mod is None:
        raise ColiError(f"general.architecture '{arch}' is not supported (supported: {', '.join(sorted(ARCHITECTURES))})")
    return importlib.import_module(f"coli.models.{mod}").Model


def model_class(g):
    """The ``Model`` class for a ``GGUFModel`` (or a ``coli.hf_folder.HFModel``, which names its GGUF
    architecture the same way); ColiError naming the file and architecture if unsupported, and saying what a
    vision/audio projector file (llama.cpp's ``--mmproj`` output, architecture ``clip``) is."""
    if g.arch == "clip":
        kind = g.get("clip.projector_type", "?")
        raise ColiError(f"{g.path.name}: a vision/audio projector file (general.architecture 'clip', projector "
                        f"'{kind}'), the multimodal part of a model: coli runs text models only; give the text "
                        "model's GGUF")
    try:
        return model_class_of(g.arch)
    except ColiError as e:
        raise ColiError(f"{g.path.name}: {e}") from None


def model_args(g):
    """``(Model class, its arguments)`` of a ``GGUFModel`` or ``HFModel`` ``g``: :func:`model_class`, its
    ``args_from(g)``, then :func:`check_blocks`. What coli run (``coli.runtime.build``) and coli plan read of a file
    before anything is sized; ColiError naming the file and key."""
    cls = model_class(g)
    args = cls.args_from(g)
    check_blocks(g, args.n_layers)
    return cls, args


def check_blocks(g, n_layers: int) -> None:
    """ColiError naming ``<arch>.block_count`` when one of the ``n_layers`` blocks it counts has no ``blk.N.*``
    tensor in ``g.tensors`` (a block_count of 1e6 in a 4-block file: ``coli plan`` sized 1,000,000 layers of KV
    cache and ``coli run`` failed on the first missing tensor). Blocks beyond ``n_layers`` are not refused: a
    family may count blocks it does not run (MiMo-V2's nextn layers)."""
    have = set()
    for name in g.tensors:
        if name.startswith("blk."):
            idx = name.split(".", 2)[1]
            if idx.isdigit():
                have.add(int(idx))
    missing = next((il for il in range(n_layers) if il not in have), None)
    if missing is not None:
        key = f"{g.arch}.block_count"
        count = f"{len(have)} block{'s' if len(have) != 1 else ''}" if have else "no blk.N tensors"
        raise ColiError(f"{g.path.name}: metadata '{key}' is {g.get(key, n_layers)}, but the file has {count} "
                        f"(no tensor 'blk.{missing}.*')")

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

"""One module per architecture (GGUF ``general.architecture`` -> module)."""
from __future__ import annotations

import importlib

from coli.errors import ColiError

ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "gemma3": "gemma3",
    "qwen2moe": "qwen2moe",
    "qwen3moe": "qwen3moe",
    "olmoe": "olmoe",
    "gpt-oss": "gptoss",
    "mimo2": "mimo2",
}


def model_class(g):
    """The ``Model`` class for a ``GGUFModel`` (or a ``coli.hf_folder.HFModel``, which names its GGUF
    architecture the same way); ColiError naming the file and architecture if unsupported."""
    mod = ARCHITECTURES.get(g.arch)
    if mod is None:
        raise ColiError(f"{g.path.name}: general.architecture '{g.arch}' is not supported "
                        f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return importlib.import_module(f"coli.models.{mod}").Model

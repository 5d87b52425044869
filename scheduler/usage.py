"""Routing history: ``.coli_usage``, per (layer, expert) routing counts and tokens seen.

Where: ``--usage PATH`` if given; else ``.coli_usage`` beside the model file (the folder is the model's,
as colibri keeps it in the snapshot folder, seed S0:L406-408); when that folder is not writable, the user's
cache (``<cache>/usage/<model file name>-<size>.coli_usage``).

Format (ours; the seeds give none): UTF-8 JSON, one entry per model file of the folder::

    {"format": "coli_usage", "version": 1,
     "models": {"<model file name>": {"size": <file bytes>, "layers": L, "experts": E,
                                       "tokens": <tokens routed>, "counts": [[c_0_0, ...], ...]}}}

``counts[l][e]`` is how many times layer ``l`` routed a token to expert ``e`` (a top-k slot, whichever side
computed it); layers without experts hold zeros. ``tokens`` counts tokens that went through the MoE layers,
so ``sum(counts) == tokens * top_k * moe_layers``. Every run adds its routing and saves at the end,
atomically (temp file in the same folder, fsync, ``os.replace``), so a crash never leaves a half-written file.
An entry whose shape does not match the model is ignored with a note and replaced at the next save.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from coli.paths import atomic_write_text, cache_dir


def default_path(model_path: str | os.PathLike) -> Path:
    """``.coli_usage`` beside the model, or the user's cache when the model's folder is read-only."""
    model_path = Path(model_path).resolve()
    folder = model_path.parent
    if os.access(folder, os.W_OK):
        return folder / ".coli_usage"
    st = model_path.stat()
    return cache_dir("usage") / f"{model_path.name}-{st.st_size}.coli_usage"


class Usage:
    """Routing counts of one model: ``counts`` int64 [L, E], ``tokens`` int."""

    def __init__(self, path: Path, model_path: Path, n_layers: int, n_experts: int):
        self.path = Path(path)
        self.model_name = Path(model_path).name
        self.model_size = Path(model_path).stat().st_size
        self.counts = np.zeros((n_layers, n_experts), dtype=np.int64)
        self.tokens = 0
        self.loaded = False

    @classmethod
    def open(cls, model_path, n_layers: int, n_experts: int, path=None, quiet: bool = False) -> "Usage":
        """Load the history for ``model_path`` (zeros if none or unreadable: a note on stderr, never a crash)."""
        p = Path(path) if path else default_path(model_path)
        u = cls(p, Path(model_path), n_layers, n_experts)
        if p.exists():
            try:
                doc = json.loads(p.read_text())
                ent = doc.get("models", {}).get(u.model_name)
                if ent is not None:
                    c = np.asarray(ent["counts"], dtype=np.int64)
                    if c.shape == u.counts.shape and ent.get("size") == u.model_size:
                        u.counts[:] = c
                        u.tokens = int(ent["tokens"])
                        u.loaded = True
                    elif not quiet:
                        print(f"coli: {p}: the history of {u.model_name} does not match this file "
                              f"(shape {list(c.shape)}), starting a new one", file=sys.stderr)
            except (ValueError, KeyError, TypeError, OSError) as e:
                if not quiet:
                    print(f"coli: {p}: unreadable routing history ({e}), starting a new one", file=sys.stderr)
        return u

    def add(self, layer: int, expert_ids: np.ndarray) -> None:
        """Count the routing of one layer step: ``expert_ids`` int [R, K]."""
        np.add.at(self.counts[layer], np.asarray(expert_ids).reshape(-1), 1)

    def add_tokens(self, n: int) -> None:
        self.tokens += int(n)

    def hottest(self, layer: int) -> np.ndarray:
        """Expert ids of ``layer`` by descending count (ties: lower id first)."""
        c = self.counts[layer]
        return np.lexsort((np.arange(len(c)), -c))

    def save(self) -> None:
        """Merge this model's entry into the file and replace it atomically."""
        doc = {"format": "coli_usage", "version": 1, "models": {}}
        if self.path.exists():
            try:
                old = json.loads(self.path.read_text())
                if isinstance(old.get("models"), dict):
                    doc["models"] = old["models"]
            except (ValueError, OSError):
                pass
        doc["models"][self.model_name] = {
            "size": self.model_size,
            "layers": int(self.counts.shape[0]),
            "experts": int(self.counts.shape[1]),
            "tokens": int(self.tokens),
            "counts": self.counts.tolist(),
        }
        atomic_write_text(self.path, json.dumps(doc, separators=(",", ":")))

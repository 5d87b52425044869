"""Routing history: ``.coli_usage``, per (layer, expert) routing counts and tokens seen.

Where: ``--usage PATH`` if given; else ``.coli_usage`` beside the model file (the folder is the model's,
as the C engine keeps it in the snapshot folder); when that folder is not writable, the user's
cache (``<cache>/usage/<model file name>-<size>.coli_usage``).

Format (ours; the seeds give none): UTF-8 JSON, one entry per model file of the folder::

    {"format": "coli_usage", "version": 1,
     "models": {"<model file name>": {"size": <file bytes>, "layers": L, "experts": E,
                                       "tokens": <tokens routed>, "counts": [[c_0_0, ...], ...]}}}

``counts[l][e]`` is how many times layer ``l`` routed a token to expert ``e`` (a top-k slot, whichever side
computed it); layers without experts hold zeros. ``tokens`` counts tokens that went through the MoE layers,
so ``sum(counts) == tokens * top_k * moe_layers``. Routing is committed per finished forward step (a step
cut short counts nothing). Every run adds its own counts at the end: under a lock on the folder it re-reads
the file and adds only this run's counts (two runs at once both keep theirs), then replaces it atomically
(temp file in the same folder, fsync, ``os.replace``), so a crash never leaves a half-written file.
An entry whose shape does not match the model is ignored with a note and replaced at the next save. A file
that is not a routing history is never overwritten: ``--usage`` on one is a ``ColiError``; at the default
place it is renamed aside with a note.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from pathlib import Path

import numpy as np

from coli.base.errors import ColiError
from coli.base.paths import atomic_write_text, optional_cache_dir


def default_path(model_path: str | os.PathLike) -> Path | None:
    """``.coli_usage`` beside the model, or the user's cache when the model's folder is read-only; None
    (one warning: the run keeps its routing in memory only) when the cache cannot be written either."""
    model_path = Path(model_path).resolve()
    folder = model_path.parent
    if os.access(folder, os.W_OK):
        return folder / ".coli_usage"
    st = model_path.stat()
    d = optional_cache_dir("usage", what="the routing history is not kept (the model's folder is read-only)")
    return d / f"{model_path.name}-{st.st_size}.coli_usage" if d is not None else None


def _lock_folder(folder: Path):
    """An exclusive ``flock`` on the folder itself (Linux locks directories; no lock file left beside the
    model), held while a save re-reads and replaces the history. Blocks until the other run's save ends."""
    @contextlib.contextmanager
    def held():
        fd = os.open(folder, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    return held()


def _read_history(p: Path) -> dict | None:
    """The document of a routing history file, None if there is no file. ``NotHistory`` when the file is
    not one coli wrote (not JSON, or no ``"format": "coli_usage"``, or a version this coli does not know)."""
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise NotHistory("not JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != "coli_usage":
        raise NotHistory("no \"format\": \"coli_usage\"")
    if doc.get("version") != 1:
        raise NotHistory(f"version {doc.get('version')!r} (this coli writes version 1)")
    if not isinstance(doc.get("models"), dict):
        raise NotHistory("no \"models\" object")
    return doc


class NotHistory(ValueError):
    """A file that is not a routing history coli wrote (so coli never replaces it)."""


class Usage:
    """Routing counts of one model: ``counts`` int64 [L, E], ``tokens`` int (committed: every finished
    forward step), ``path`` (None: kept in memory only).

    ``add(layer, expert_ids)`` stages a layer's routing; ``add_tokens(n)`` (the model calls it when a forward
    step of ``n`` tokens finished) commits what was staged, so a step cut short (Ctrl-C, SIGTERM, an error)
    leaves no half-counted routing. ``save()`` adds only this run's committed counts to what the file holds
    now, under a lock on the folder: two runs on one history both keep their counts.
    """

    def __init__(self, path: Path | None, model_path: Path, n_layers: int, n_experts: int):
        self.path = Path(path) if path is not None else None
        self.model_name = Path(model_path).name
        self.model_size = Path(model_path).stat().st_size
        self.counts = np.zeros((n_layers, n_experts), dtype=np.int64)
        self.tokens = 0
        self.loaded = False
        self._pending = np.zeros_like(self.counts)
        self._saved_counts = self.counts.copy()  # what the file held for this model at the last load/save
        self._saved_tokens = 0

    @classmethod
    def open(cls, model_path, n_layers: int, n_experts: int, path=None, quiet: bool = False) -> "Usage":
        """Load the history for ``model_path`` (zeros if none, or if the entry does not match the model: a
        note). A file that is not a routing history is never overwritten: given as ``path`` (``--usage``),
        ``ColiError``; at the default place, it is renamed aside (``<name>.not-history-<n>``) with a note."""
        p = Path(path) if path else default_path(model_path)
        u = cls(p, Path(model_path), n_layers, n_experts)
        if p is None:
            return u
        try:
            doc = _read_history(p)
        except NotHistory as e:
            if path:
                raise ColiError(f"--usage {p}: not a coli routing history ({e}); coli will not overwrite it, "
                                f"give another path") from None
            aside = _move_aside(p)
            print(f"coli: {p}: not a coli routing history ({e}): moved to {aside.name}, starting a new one",
                  file=sys.stderr)
            return u
        except OSError as e:
            raise ColiError(f"--usage {p}: {e.strerror or e}") from None
        if doc is None:
            return u
        ent = doc["models"].get(u.model_name)
        if ent is not None:
            c = _entry_counts(ent)
            if c is not None and c.shape == u.counts.shape and ent.get("size") == u.model_size:
                u.counts[:] = c
                u.tokens = int(ent["tokens"])
                u.loaded = True
                u._saved_counts = u.counts.copy()
                u._saved_tokens = u.tokens
            elif not quiet:
                shape = list(c.shape) if c is not None else "unreadable"
                print(f"coli: {p}: the history of {u.model_name} does not match this file "
                      f"(shape {shape}), starting a new one", file=sys.stderr)
        return u

    def add(self, layer: int, expert_ids: np.ndarray) -> None:
        """Stage the routing of one layer step: ``expert_ids`` int [R, K] (committed by ``add_tokens``)."""
        pend = self._pending[layer]
        pend += np.bincount(np.asarray(expert_ids).reshape(-1), minlength=len(pend))  # an id >= E: shape error

    def add_layers(self, layers: np.ndarray, expert_ids: np.ndarray) -> None:
        """Stage one row's routing of several layers at once: ``layers`` int [n] (distinct), ``expert_ids`` int
        [n, K] (each layer's routed ids), as :meth:`add` of each layer (one bincount for all of them)."""
        pend = self._pending
        E = pend.shape[1]
        ids = np.asarray(expert_ids)
        if ids.size and (ids.max() >= E or (ids.dtype.kind == "i" and ids.min() < 0)):     # add's shape error
            raise ValueError(f"expert ids outside 0 .. {E - 1}")
        flat = (np.asarray(layers, np.int64)[:, None] * E + ids.astype(np.int64)).reshape(-1)
        pend.reshape(-1)[:] += np.bincount(flat, minlength=pend.size)

    def add_tokens(self, n: int) -> None:
        """A forward step of ``n`` tokens finished: commit the routing staged since the last one."""
        self.counts += self._pending
        self._pending[:] = 0
        self.tokens += int(n)

    def discard_pending(self) -> None:
        """Drop routing staged by a step that did not finish."""
        self._pending[:] = 0

    @property
    def run_tokens(self) -> int:
        """Tokens this process committed since the last load or save."""
        return self.tokens - self._saved_tokens

    def hottest(self, layer: int) -> np.ndarray:
        """Expert ids of ``layer`` by descending count (ties: lower id first)."""
        c = self.counts[layer]
        return np.lexsort((np.arange(len(c)), -c))

    def save(self) -> None:
        """Add this run's committed counts to the file's entry for this model and replace the file atomically,
        under a lock on its folder (re-read inside the lock, so another run's save in between is kept).
        ``ColiError`` if the file became something that is not a history; ``OSError`` from the disk."""
        if self.path is None:
            return
        d_counts = self.counts - self._saved_counts
        d_tokens = self.tokens - self._saved_tokens
        with _lock_folder(self.path.parent if str(self.path.parent) else Path(".")):
            try:
                doc = _read_history(self.path)
            except NotHistory as e:
                raise ColiError(f"{self.path}: not a coli routing history any more ({e}); not overwritten") from None
            if doc is None:
                doc = {"format": "coli_usage", "version": 1, "models": {}}
            ent = doc["models"].get(self.model_name)
            base, base_tokens = np.zeros_like(self.counts), 0
            if ent is not None:
                c = _entry_counts(ent)
                if c is not None and c.shape == self.counts.shape and ent.get("size") == self.model_size:
                    base, base_tokens = c, int(ent["tokens"])
            new = base + d_counts
            tokens = base_tokens + d_tokens
            doc["models"][self.model_name] = {
                "size": self.model_size,
                "layers": int(new.shape[0]),
                "experts": int(new.shape[1]),
                "tokens": int(tokens),
                "counts": new.tolist(),
            }
            atomic_write_text(self.path, json.dumps(doc, separators=(",", ":")))
        self.counts = new
        self.tokens = int(tokens)
        self._saved_counts = new.copy()
        self._saved_tokens = self.tokens


def _entry_counts(ent) -> np.ndarray | None:
    try:
        c = np.asarray(ent["counts"], dtype=np.int64)
        int(ent["tokens"])
    except (KeyError, TypeError, ValueError):
        return None
    return c if c.ndim == 2 and (c >= 0).all() else None


def _move_aside(p: Path) -> Path:
    """Rename ``p`` to the first free ``<name>.not-history-<n>`` beside it (never replacing anything)."""
    for n in range(1, 10000):
        q = p.with_name(f"{p.name}.not-history-{n}")
        try:
            os.link(p, q)  # fails if q exists: nothing is ever replaced
        except FileExistsError:
            continue
        os.unlink(p)
        return q
    raise OSError(f"{p}: no free name to move it aside")

"""Where coli keeps what it downloads or builds: the user's cache directory.

``COLI_CACHE`` overrides; else ``$XDG_CACHE_HOME/coli``; else ``~/.cache/coli``.
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """Return (and create) ``<cache>/<parts...>``."""
    root = os.environ.get("COLI_CACHE")
    if root:
        base = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = Path(xdg) / "coli" if xdg else Path.home() / ".cache" / "coli"
    p = base.joinpath(*parts)
    p.mkdir(parents=True, exist_ok=True)
    return p

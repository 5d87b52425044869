"""Where coli keeps what it downloads or builds: the user's cache directory.

``COLI_CACHE`` overrides; else ``$XDG_CACHE_HOME/coli``; else ``~/.cache/coli``.
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """Return (and create) ``<cache>/<parts...>``."""
    from .settings import get

    root = get("COLI_CACHE")
    if root:
        base = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = Path(xdg) / "coli" if xdg else Path.home() / ".cache" / "coli"
    p = base.joinpath(*parts)
    p.mkdir(parents=True, exist_ok=True)
    return p


def atomic_write_text(path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one, never a part:
    a temp file in the same folder, fsync, then ``os.replace``; the temp file is removed on any failure.
    The file gets the mode ``open()`` would give it (0666 less the umask)."""
    import tempfile

    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def check_writable_file(path, what: str) -> "Path":
    """ColiError unless ``path``'s folder exists and is writable (user-given output paths: --trace, --usage)."""
    from .errors import ColiError

    p = Path(path)
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise ColiError(f"{what} {p}: folder {folder} does not exist")
    if p.is_dir():
        raise ColiError(f"{what} {p}: is a folder")
    if not os.access(folder, os.W_OK):
        raise ColiError(f"{what} {p}: folder {folder} is not writable")
    return p

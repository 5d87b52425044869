"""Where coli keeps what it downloads or builds: the user's cache directory.

``COLI_CACHE`` overrides (an absolute path: a relative one is a ColiError); else ``$XDG_CACHE_HOME/coli``
(when absolute: the XDG spec ignores a relative one); else ``~/.cache/coli``. When that folder cannot be
made or written (``HOME`` a file, ``COLI_CACHE=/proc/x``, a uid without a passwd entry and no ``HOME``),
:func:`cache_dir` raises ``ColiError`` naming the variable; callers that can do without the cache (Numba's
compiled kernels, the default routing-history place) use :func:`optional_cache_dir`, which says so once on
stderr and returns None. A cached file is looked for with :func:`cached_file` (nothing made or checked), so a
read-only cache that holds the models serves them.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

from .errors import ColiError
from .settings import get

_warned: set = set()


def cache_root() -> tuple[Path, str]:
    """The cache folder (not created) and where it came from (``"COLI_CACHE=..."``, ``"HOME=..."``).
    ColiError when there is no home folder to put it in."""
    root = get("COLI_CACHE")
    if root:
        return Path(root), f"COLI_CACHE={root}"
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):  # the XDG spec: a relative value is invalid and ignored
        return Path(xdg) / "coli", f"XDG_CACHE_HOME={xdg}"
    try:
        home = Path.home()
    except (RuntimeError, KeyError, OSError):
        raise ColiError(f"cache: no home folder (HOME is unset and uid {os.getuid()} has no passwd entry); "
                        "set COLI_CACHE to a writable folder") from None
    return home / ".cache" / "coli", f"HOME={os.environ.get('HOME', home)}"


def user_path(s) -> str:
    """A path as the user gave it (a flag's value, ``-m``): a leading ``~`` no shell expanded (quoted, a service's
    or a config file's line) is the home folder, as COLI_CACHE's (``os.path.expanduser``); a file literally named
    so, when one exists, is itself. One rule for every path flag (argparse's ``type=`` of each)."""
    s = os.fspath(s)
    return os.path.expanduser(s) if s.startswith("~") and not os.path.exists(s) else s


def cached_file(*parts: str) -> Path:
    """``<cache>/<parts...>``, neither made nor checked writable: where a cached file (a model, the demo) is looked
    for first, so a read-only cache that holds it (a shared or baked-in folder) serves it."""
    base, _ = cache_root()
    return base.joinpath(*parts)


def cache_dir(*parts: str) -> Path:
    """Return (and create) ``<cache>/<parts...>``, checked writable. ColiError naming the variable the
    folder came from when it cannot be made or written."""
    base, origin = cache_root()
    p = base.joinpath(*parts)
    try:
        p.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=p).close()  # writable, as Numba checks it (os.access lies for root)
    except OSError as e:
        raise ColiError(f"cache folder {p} ({origin}): {e.strerror or e}; set COLI_CACHE to a writable "
                        "folder") from None
    return p


def optional_cache_dir(*parts: str, what: str) -> Path | None:
    """:func:`cache_dir`, or None with one warning line on stderr (once per process) saying ``what`` goes
    without it, for uses that can do without the disk cache."""
    try:
        return cache_dir(*parts)
    except ColiError as e:
        if what not in _warned:
            _warned.add(what)
            try:
                print(f"coli: warning: {e}; {what}", file=sys.stderr)
            except (OSError, ValueError, AttributeError):  # stderr closed too: nothing to say it on
                pass
        return None


def atomic_write_text(path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one, never a part:
    a temp file in the same folder, fsync, then ``os.replace``; the temp file is removed on any failure.
    The file gets the mode ``open()`` would give it (0666 less the umask)."""
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


def check_writable_file(path, what: str, overwrite_if=None) -> "Path":
    """ColiError unless ``path``'s folder exists and is writable (user-given output paths: --trace, --usage).
    ``overwrite_if(path) -> bool``: when given and the file exists, it must say the file is one coli wrote
    (coli never overwrites a file it did not write: ColiError otherwise)."""
    p = Path(path)
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise ColiError(f"{what} {p}: folder {folder} does not exist")
    if p.is_dir():
        raise ColiError(f"{what} {p}: is a folder")
    if not os.access(folder, os.W_OK):
        raise ColiError(f"{what} {p}: folder {folder} is not writable")
    if overwrite_if is not None and p.exists() and not overwrite_if(p):
        raise ColiError(f"{what} {p}: exists and is not a file coli wrote; coli will not overwrite it, give another path")
    return p


def is_json_array_of_objects(path) -> bool:
    """True when ``path`` holds a JSON array of objects (a Chrome trace as ``--trace`` writes it) or is empty."""
    try:
        raw = Path(path).read_bytes()
        if not raw.strip():
            return True
        doc = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(doc, list) and all(isinstance(e, dict) for e in doc)


@contextlib.contextmanager
def cache_lock(lock: Path, waiting: str | None = None):
    """Hold an advisory lock (``fcntl.flock``) on the file ``lock`` in a cache folder for the block, so that two
    processes (or threads) making the same cached file (a model's download, the demo's build) take turns: the
    second waits, then finds the file made. ``waiting``: a line printed on stderr when the lock is busy (a silent
    wait looks hung); None says nothing. Without fcntl (not POSIX) no lock: the file's ``os.replace`` still keeps it
    whole."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock, "a+b") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                print(waiting, file=sys.stderr, flush=True)
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)

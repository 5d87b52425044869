"""A model given by path or by name, as the path ``coli run -m``, ``coli.Engine(...)``, ``coli plan`` and the scripts
open: an existing file or folder as it is; a name of ``coli.fetch.MODEL_NAMES`` fetched (coli/fetch.py) or, ``demo``,
built (coli/demo.py) on first use. Above both, so neither imports the other to reach it."""
from __future__ import annotations

import os

from .base.errors import ColiError
from .base.paths import user_path
from .fetch import MODEL_NAMES, check_folder, model_path


def resolve(name, quiet: bool = False) -> str:
    """A model given by path or by name as a path: an existing file or folder as it is, a name of ``MODEL_NAMES``
    fetched (or, ``demo``, built) on first use. ColiError naming the value and the names when it is neither. A
    leading ``~`` no shell expanded (quoted, a service's or a config file's line) is the home folder, as COLI_CACHE's."""
    name = user_path(name)
    if not os.path.exists(name) and name.lower() in MODEL_NAMES:
        key = MODEL_NAMES[name.lower()]
        if key is None:
            from .demo import demo_model_path  # gguf loads here, not at every coli start (0.5 s)

            return str(demo_model_path(quiet=quiet))
        return str(model_path(key, quiet=quiet))
    if not os.path.exists(name):
        import difflib

        near = difflib.get_close_matches(name.lower(), MODEL_NAMES, n=1) if os.sep not in name else []
        raise ColiError(f"{name}: no such file" + (f"; did you mean {near[0]}?" if near else "")
                        + f" (give a GGUF path or a model name: "
                        f"{', '.join(k for k in MODEL_NAMES if k not in ('gemma3', 'qwen25'))}; see coli models)")
    check_folder(name)
    return name

"""coli: Mixture-of-Experts inference on the machines people own."""
from .base.paths import cache_dir


def __getattr__(name):  # lazy: `import coli` stays light (the CLI's error paths must be fast)
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(name)

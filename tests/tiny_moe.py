"""A tiny MoE GGUF for tool tests (bench, plan, tune): ``scripts/make_synthetic_moe.py`` with 2 layers,
d 64, 4 experts top-2, expert FFN 64, vocabulary 256, Q8_0 (random weights; about 180 KB, loads in a blink)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--layers", "2", "--d", "64", "--heads", "2", "--experts", "4", "--top-k", "2", "--expert-ff", "64",
        "--vocab", "256", "--type", "Q8_0"]


def build_tiny_moe(folder) -> Path:
    out = Path(folder) / "tiny-moe.gguf"
    if not out.exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_synthetic_moe.py"), "-o", str(out), *ARGS],
                       check=True, capture_output=True, timeout=120)
    return out

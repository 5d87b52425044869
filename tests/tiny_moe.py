"""A tiny MoE GGUF for tool tests (bench, plan, tune): ``scripts/make_synthetic_moe.py`` with 2 layers,
d 64, 4 experts top-2, expert FFN 64, vocabulary 256, Q8_0 (random weights; about 180 KB, loads in a blink); the
device tests' larger one with ``DEVICE_ARGS``."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--layers", "2", "--d", "64", "--heads", "2", "--experts", "4", "--top-k", "2", "--expert-ff", "64",
        "--vocab", "256", "--type", "Q8_0"]


# the device tests' MoE (tests/vulkan/test_device_layers.py, test_device_chain.py, test_device_prompt_routes.py): 4 layers
# of d 128, 8 experts top-3, Q8_0
DEVICE_ARGS = ["--layers", "4", "--d", "128", "--heads", "4", "--experts", "8", "--top-k", "3", "--expert-ff", "96",
               "--vocab", "300", "--type", "Q8_0", "--seed", "7"]


def build_tiny_moe(folder, args=ARGS, name: str = "tiny-moe.gguf") -> Path:
    """``folder/name`` built by ``scripts/make_synthetic_moe.py`` with ``args`` (once: an existing file is kept)."""
    out = Path(folder) / name
    if not out.exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_synthetic_moe.py"), "-o", str(out), *args],
                       check=True, capture_output=True, timeout=120)
    return out

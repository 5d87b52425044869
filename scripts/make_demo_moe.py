#!/usr/bin/env python3
"""Build the coli demo MoE (SmolLM2-135M-Instruct upcycled to a Mixtral-architecture GGUF).

Without ``-o`` the file goes to the user's cache (``coli.demo.demo_model_path``; reused if already built);
with ``-o PATH`` it is written there (atomically; replaces an existing file). Prints the path on stdout,
progress on stderr. Examples::

    python scripts/make_demo_moe.py                                  # the default: 8 experts, top-2, Q8_0, 5% noise
    python scripts/make_demo_moe.py --noise 0 --expert-type same     # exactly the dense model (Q4_1 copies)
    python scripts/make_demo_moe.py --experts 4 --expert-type F16 -o smollm2-moe-4x-f16.gguf   # llama-bench peer file

See docs/demo_moe.md for the construction.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from coli import demo
    from coli.base.errors import ColiError

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--noise", type=float, default=0.05, help="relative RMS noise per expert (default 0.05)")
    ap.add_argument("--expert-type", choices=demo.EXPERT_TYPES, default="Q8_0",
                    help="experts' GGUF type; 'same' keeps the dense Q4_1 (byte copies when --noise 0)")
    ap.add_argument("--experts", type=int, default=8, help="number of experts E (default 8)")
    ap.add_argument("--top-k", type=int, default=2, help="experts used per token (default 2)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the noise and the router (default 0)")
    ap.add_argument("-o", "--output", type=Path, help="write here instead of the user's cache")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    a = ap.parse_args(argv)
    try:
        if a.output is None:
            path = demo.demo_model_path(noise=a.noise, expert_type=a.expert_type, n_experts=a.experts,
                                        top_k=a.top_k, seed=a.seed, quiet=a.quiet)
        else:
            from coli.fetch import model_path

            path = a.output
            demo.build_demo_moe(model_path("smollm2", quiet=a.quiet), path, noise=a.noise,
                                expert_type=a.expert_type, n_experts=a.experts, top_k=a.top_k, seed=a.seed,
                                quiet=a.quiet)
    except ColiError as e:
        print(f"coli: {e}", file=sys.stderr)
        return e.exit_code
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

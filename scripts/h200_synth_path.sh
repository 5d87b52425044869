#!/usr/bin/env bash
# Prints where the H200 scripts keep the synthetic MoE (scripts/make_synthetic_moe.py, ~7.5 GB): a file already in
# /dev/shm/h2 or /tmp/h2 first; else /dev/shm/h2 when /dev/shm has room for it (RAM: written in 32-40 s on the H200,
# 2026-12-01), else /tmp/h2 (the machine's disk: 370 s).
for d in /dev/shm/h2 /tmp/h2; do
  [ -s "$d/synth.gguf" ] && { echo "$d/synth.gguf"; exit 0; }
done
a=$(df --output=avail -k /dev/shm 2>/dev/null | tail -1)
if [ "${a:-0}" -gt 12000000 ] 2>/dev/null; then d=/dev/shm/h2; else d=/tmp/h2; fi
mkdir -p "$d" && echo "$d/synth.gguf"

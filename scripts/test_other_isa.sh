#!/usr/bin/env bash
# Runs the exactness-sensitive tests (-m exactness) with the test process (its transformers, diffusers and in-process
# Eric references) capped one instruction set below this host's best (AVX-512 -> AVX2, AVX2 -> SSE4: torch, oneDNN,
# MKL) while the Erics, Geris and vLLMs it starts run on the best: every comparison crosses instruction sets, so one
# exact only by one CPU's rounding fails here. (CI runs the same crossing for the servers of the tests that need it.)
# usage: bash scripts/test_other_isa.sh [pytest args, e.g. tests/geri/test_geri_server.py]
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
isa=$(PYTHONPATH=. "$py" -m eric_epd.testing.exactness)
[ -n "$isa" ] || { echo "no lower instruction set to move to on this host" >&2; exit 1; }
echo "+ $isa" | tr '\n' ' '; echo
# shellcheck disable=SC2086
exec env $isa "$py" -m pytest -q -m exactness "${@:-tests}"

#!/usr/bin/env bash
# braid against DeepSpeed's shared-memory all-reduce (the `deepspeed_shm_comm`
# op that deepspeed.comm.inference_all_reduce runs on CPU tensors when all
# ranks are on one host), side by side in one run on this host: DeepSpeed,
# torch.distributed on the braid backend, braid's Python API and braid's Rust
# API (braid-perf), float32 and bfloat16, 8 B .. 64 MiB, on 2 and 4 ranks, and
# the ratios braid / DeepSpeed (scripts/deepspeed_compare.py says how).
#
#   scripts/deepspeed-compare.sh [ARGS...]    (ARGS go to deepspeed_compare.py:
#                                              --np 2 --dtypes bfloat16 --sizes 8 1M --rounds 3 --json F ...)
#
# The venv is DS_VENV (default ~/.cache/braid/deepspeed-venv), made once and
# reused: deepspeed (with ninja: it builds its op just in time with the
# system C++ compiler, under $DS_VENV/torch_extensions), numpy, and this
# tree's braid wheel (maturin build --release, each run). torch (>= 2.15):
# the venv's own if it has one; else, when TORCH_VENV (default
# ~/.cache/braid/wheel-venv, the venv scripts/test.sh makes) has torch, a .pth
# file makes that venv's packages visible instead of a second ~3 GB copy
# (this venv's own packages come first); else pip installs torch.
# MATURIN (default ~/.cache/braid/wheel-build/bin/maturin, else maturin on
# PATH) builds the wheel; cargo builds braid-perf (CARGO_TARGET_DIR is honoured).
# Run it on an otherwise idle machine.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/braid
venv=${DS_VENV:-$cache/deepspeed-venv}
torch_venv=${TORCH_VENV:-$cache/wheel-venv}
target=${CARGO_TARGET_DIR:-$here/target}
pip_q=(-m pip install -q --disable-pip-version-check)

if [ ! -x "$venv/bin/python" ]; then
  echo "== a venv at $venv"
  python3 -m venv "$venv"
fi
py=$venv/bin/python
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if ! "$py" -c 'import torch' 2>/dev/null; then
  if [ -x "$torch_venv/bin/python" ] && "$torch_venv/bin/python" -c 'import torch' 2>/dev/null; then
    echo "== torch: $torch_venv's (through $site/zz-braid-torch.pth)"
    "$torch_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' >"$site/zz-braid-torch.pth"
  else
    echo "== torch from the package index (about 3 GB)"
    "$py" "${pip_q[@]}" "torch>=2.15"
  fi
fi
if ! "$py" -c 'import deepspeed, ninja, numpy' 2>/dev/null; then
  echo "== deepspeed, ninja, numpy"
  "$py" "${pip_q[@]}" deepspeed ninja numpy
fi

echo "== the braid wheel and braid-perf"
maturin=${MATURIN:-$cache/wheel-build/bin/maturin}
[ -x "$maturin" ] || maturin=$(command -v maturin) || {
  echo "deepspeed-compare: no maturin (set MATURIN, or pip install maturin)" >&2
  exit 1
}
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
(cd "$here/python" && CARGO_TARGET_DIR=$target "$maturin" build --release -q -o "$wheels" >/dev/null)
"$py" "${pip_q[@]}" --force-reinstall --no-deps "$wheels"/braid-*.whl
CARGO_TARGET_DIR=$target cargo build --release -q -p braid-perf --manifest-path "$here/Cargo.toml"

# ninja on PATH for DeepSpeed's just-in-time build; its build kept in the venv.
export PATH=$venv/bin:$PATH
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$venv/torch_extensions}
exec "$py" "$here/scripts/deepspeed_compare.py" --braid-perf "$target/release/braid-perf" "$@"

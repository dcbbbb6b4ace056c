#!/usr/bin/env bash
# ARM64 (aarch64) check of brisk's C++ kernels on an x86-64 Debian/Ubuntu machine, no ARM hardware involved:
#   1. every ops/csrc/*.cpp is cross-compiled (g++-aarch64-linux-gnu) for the aarch64 tiers of ops/isa.py, against
#      the headers and libraries of PyPI's aarch64 torch wheel (the version .venv has);
#   2. the x86 kernel tests run once with tests/arm64/record_cases.py, which records the kernel ops' calls (inputs,
#      outputs, what they write in place);
#   3. tests/arm64/harness.cpp (linked against the wheel's libtorch_cpu) replays them on the aarch64 libraries under
#      qemu-user, each tier on a CPU model that has only what the tier requires: neon on a Cortex-A72 (Armv8.0,
#      Raspberry Pi 4), neon-dotprod on a Neoverse N1 (Graviton2), neon-i8mm on qemu's `max`.
# Integer results must match bit for bit, float ones within a few ulps (record_cases.py says which is which). An op
# a file does not register on aarch64 is listed as "not registered": brisk runs its PyTorch reference path there.
#
# Needs root or sudo for apt (g++-aarch64-linux-gnu, qemu-user), PyPI for the wheel, and .venv (`make install`).
# Downloads and builds go to $BRISK_ARM64_DIR (default ~/.cache/brisk-arm64); a second run reuses the wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
ROOT=$PWD
WORK=${BRISK_ARM64_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/brisk-arm64}
PY=${PY:-$ROOT/.venv/bin/python}
JOBS=${JOBS:-$(nproc)}
SYSROOT=/usr/aarch64-linux-gnu
mkdir -p "$WORK"
log() { printf '[arm64 %4ds] %s\n' $((SECONDS - start)) "$*"; }

# -- toolchain and emulator
if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
  log "apt: g++-aarch64-linux-gnu qemu-user"
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends g++-aarch64-linux-gnu \
    qemu-user >/dev/null
fi

# -- the x86 kernel tests record the ops' calls (in the background, while the cross-compiles run)
CASES=$WORK/cases.pt
# the kernel tests of the decode path, less the slow ones (the whole of test_qlinear_q8.py takes minutes); GGUF's
# float-minimum and 16-element-group formats through the blocked kernels, and the token-tree attention kernel
Q8=tests/test_qlinear_q8.py
RECORD_TESTS=(tests/test_fused.py tests/test_qlinear.py tests/test_linear.py tests/test_kv_quant.py tests/test_kernels.py
              $Q8::test_kernel_equals_reference $Q8::test_bfloat16_activations_and_bias $Q8::test_group_parameters
              $Q8::test_fake_quantize_kernel_equals_the_reference_bit_for_bit
              tests/test_gguf_repack.py::test_kernels_on_repacked_weights_match_the_reference_product
              tests/test_spec_tree.py::test_tree_kernel_equals_the_reference)
log "recording the kernel ops' calls in the x86 kernel tests"
( BRISK_ARM64_CASES=$CASES PYTHONPATH=$ROOT/tests/arm64 PYTEST_ADDOPTS="" \
    "$PY" -m pytest -q -p record_cases -p no:cacheprovider "${RECORD_TESTS[@]}" >"$WORK/record.log" 2>&1 ) &
record=$!

# -- the aarch64 torch wheel: its headers, libc10 and libtorch_cpu (a CUDA build: stubs stand in for CUDA's runtime)
TORCH_VERSION=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")
TORCH=$WORK/torch-$TORCH_VERSION
if [ ! -e "$TORCH/.done" ]; then
  log "aarch64 torch $TORCH_VERSION wheel"
  "$PY" -m pip download -q "torch==$TORCH_VERSION" --platform manylinux_2_28_aarch64 --only-binary=:all: --no-deps \
    --python-version 3.11 -d "$WORK/wheels"
  rm -rf "$TORCH" && mkdir -p "$TORCH"
  "$PY" -m zipfile -e "$(ls "$WORK"/wheels/torch-"$TORCH_VERSION"-*aarch64.whl)" "$TORCH.tmp" && mv "$TORCH.tmp/torch" \
    "$TORCH/torch" && rm -rf "$TORCH.tmp"
  rm -f "$TORCH"/torch/lib/libtorch_cuda*.so  # 430 MB nothing here loads
  bash tests/arm64/cuda_stubs.sh "$TORCH/torch/lib/libtorch_cpu.so" "$TORCH/stubs"
  touch "$TORCH/.done"
fi
INC=$TORCH/torch/include
LIB=$TORCH/torch/lib

# -- cross-compile: every source for the neon tier, and for the higher tiers the sources whose code differs there
# (those testing the feature macro the tier adds). The flags are torch.utils.cpp_extension's and ops/kernels.py's.
mapfile -t TIERS < <("$PY" -c "from brisk.ops import isa
for t in reversed(isa.ARM64_TIERS): print(t.name, *t.cflags)")
BUILD=$WORK/build
rm -rf "$BUILD" && mkdir -p "$BUILD"
compile() {  # tier source cflags...
  local tier=$1 src=$2 name; shift 2
  name=$(basename "$src" .cpp)
  if aarch64-linux-gnu-g++ -DTORCH_EXTENSION_NAME="brisk_${name}_$tier" -DTORCH_API_INCLUDE_EXTENSION_H \
      -isystem "$INC" -isystem "$INC/torch/csrc/api/include" -fPIC -std=c++20 -O3 -fopenmp "$@" -c "$src" \
      -o "$BUILD/$tier/$name.o" 2>"$BUILD/$tier/$name.log" &&
     aarch64-linux-gnu-g++ -shared -fopenmp "$BUILD/$tier/$name.o" -L"$LIB" -lc10 -ltorch_cpu \
      -Wl,--allow-shlib-undefined -o "$BUILD/$tier/brisk_${name}_$tier.so" 2>>"$BUILD/$tier/$name.log"; then
    echo "ok      $tier $name"
  else
    echo "FAILED  $tier $name"; sed 's/^/    /' "$BUILD/$tier/$name.log" | grep -m 20 -i -B2 -A3 error
  fi
}
export -f compile
export INC LIB BUILD
declare -A ADDS=([neon-dotprod]="__ARM_FEATURE_DOTPROD" [neon-i8mm]="__ARM_FEATURE_(MATMUL_INT8|BF16)")
jobs_list=$BUILD/jobs
: >"$jobs_list"
for line in "${TIERS[@]}"; do
  read -r tier flags <<<"$line"
  mkdir -p "$BUILD/$tier"
  for src in src/brisk/ops/csrc/*.cpp; do
    if [ "$tier" = neon ] || grep -Eq "${ADDS[$tier]}" "$src"; then echo "$tier $src $flags" >>"$jobs_list"; fi
  done
done
log "cross-compiling $(wc -l <"$jobs_list") kernel builds, $JOBS at a time"
xargs -P "$JOBS" -L 1 bash -c 'compile "$@"' _ <"$jobs_list" | sort | tee "$BUILD/summary"
log "harness"
aarch64-linux-gnu-g++ -std=c++20 -O1 -isystem "$INC" -isystem "$INC/torch/csrc/api/include" tests/arm64/harness.cpp \
  -o "$BUILD/harness" -L"$LIB" -Wl,--no-as-needed -lc10 -ltorch_cpu -Wl,--allow-shlib-undefined
aarch64-linux-gnu-gcc -shared -fPIC -O1 tests/arm64/cpuinfo_shim.c -o "$BUILD/cpuinfo_shim.so" -ldl
failed=0
grep -q "^FAILED" "$BUILD/summary" && failed=1

log "waiting for the recording"
if ! wait $record; then
  tail -30 "$WORK/record.log"; echo "the x86 tests failed while recording"; exit 1
fi
tail -1 "$WORK/record.log" | grep -v "^$" || true
grep "^record_cases" "$WORK/record.log" || true

# -- replay under qemu-user, one process per tier (two builds of a file cannot register the same ops at once).
# qemu-user shows the guest the host's /proc/cpuinfo, whose x86 text crashes the cpuinfo library in libc10:
# cpuinfo_shim.c hands it an aarch64 one instead, listing what the emulated CPU model has.
declare -A CPU=([neon]=cortex-a72 [neon-dotprod]=neoverse-n1 [neon-i8mm]=max)
declare -A FEATURES=([neon]="fp asimd evtstrm crc32 cpuid"
  [neon-dotprod]="fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp"
  [neon-i8mm]="fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp \
i8mm bf16")
below=()  # this tier and those under it, best first
for line in "${TIERS[@]}"; do
  read -r tier _ <<<"$line"
  below=("$tier" "${below[@]}")
  libs=()
  for src in src/brisk/ops/csrc/*.cpp; do  # each file's build of the best tier up to this one that has one
    name=$(basename "$src" .cpp)
    for t in "${below[@]}"; do
      if [ -e "$BUILD/$t/brisk_${name}_$t.so" ]; then libs+=("$BUILD/$t/brisk_${name}_$t.so"); break; fi
    done
  done
  for ((i = 0; i < $(nproc --all); ++i)); do
    printf 'processor\t: %d\nFeatures\t: %s\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\n' \
      "$i" "${FEATURES[$tier]}"
    printf 'CPU part\t: 0xd0c\nCPU revision\t: 0\n\n'
  done >"$BUILD/cpuinfo-$tier"
  log "replaying on $tier (qemu-aarch64 -cpu ${CPU[$tier]})"
  # 2 OpenMP threads: parallel loops are exercised, and qemu-user's threads stay few (dozens of them crashed it)
  if ! qemu-aarch64 -cpu "${CPU[$tier]}" -L "$SYSROOT" -E LD_LIBRARY_PATH="$LIB:$TORCH/stubs" -E OMP_NUM_THREADS=2 \
      -E LD_PRELOAD="$BUILD/cpuinfo_shim.so" -E BRISK_FAKE_CPUINFO="$BUILD/cpuinfo-$tier" \
      "$BUILD/harness" "$CASES" "${libs[@]}" 2> >(grep -v MIDR_EL1 >&2); then
    failed=1
  fi
done
log "done: $([ $failed = 0 ] && echo passed || echo FAILED)"
exit $failed

#!/usr/bin/env bash
# Stand-ins for the CUDA runtime libraries libtorch_cpu.so of PyPI's aarch64 torch wheel (a CUDA build) names as
# needed: the dynamic loader wants each file, with the symbol versions the wheel's libraries bind to, before
# anything runs. The harness never reaches CUDA, so every function is an unused stub.
#   cuda_stubs.sh LIBTORCH_CPU_SO OUT_DIR
set -euo pipefail
lib=$1 out=$2
mkdir -p "$out"
for needed in $(aarch64-linux-gnu-readelf -d "$lib" | sed -n 's/.*NEEDED.*\[\(lib\(cu\|nv\)[^]]*\)\]/\1/p'); do
  [ -e "$(dirname "$lib")/$needed" ] && continue  # the wheel ships it (nvpl: NVIDIA's BLAS for ARM, real code)
  syms=$(aarch64-linux-gnu-objdump -T "$lib" | awk -v v="($needed)" '/\*UND\*/ && index($0, v) {print $NF}' | sort -u)
  {
    for s in $syms; do echo "int $s(void) { return 999; }"; done
  } > "$out/$needed.c"
  { echo "$needed {"; [ -n "$syms" ] && echo "  global: $(echo $syms | sed 's/ /; /g');"; echo "  local: *;"; echo "};"; } \
    > "$out/$needed.map"
  aarch64-linux-gnu-gcc -shared -fPIC -o "$out/$needed" "$out/$needed.c" -Wl,-soname,"$needed" \
    -Wl,--version-script,"$out/$needed.map"
done

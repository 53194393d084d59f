#!/usr/bin/env bash
# The GPU path checked on a machine with an NVIDIA GPU and no Rust toolchain, from binaries built
# on a machine without one. Prepare here (about 20 minutes of building on 2 cores):
#
#   bench/gpu_check.sh --prepare        # builds gpu-check/medley (--features cuda) and the
#                                       # medley-gpu test binary, stripped
#
# then, on the GPU machine, from the repository root with gpu-check/ carried along:
#
#   bench/gpu_check.sh                  # at most about 10 minutes
#
# It finds the driver and the libraries (nvidia-smi, libcuda, libnvrtc, libcublas, libnccl, in the
# loader's cache or in Python's nvidia-* wheels), runs `medley bench device --device cuda` (bf16
# and f32 matrix multiplies against the datasheet; the tiny model trained 50 steps on the CPU and
# on the GPU from the same weights and batches, losses compared step by step, step times side by
# side) and the medley-gpu tests that need a GPU (a one-rank NCCL all-reduce, the CPU-forwarding
# bridge between device buffers). Every part prints what it saw; the script's status is the worst.
set -uo pipefail
cd "$(dirname "$0")/.."
out=gpu-check

if [ "${1:-}" = "--prepare" ]; then
    set -e
    mkdir -p "$out"
    cargo build --release --features cuda
    cp target/release/medley "$out/medley"
    test_binary=$(cargo test --release -p medley-gpu --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu" and m.get("executable"):
        print(m["executable"])')
    cp "$test_binary" "$out/medley-gpu-tests"
    strip "$out/medley" "$out/medley-gpu-tests"
    ls -la "$out"
    exit 0
fi

status=0
step() {
    echo
    echo "== $1"
    shift
    timeout 300 "$@" || { echo "!! failed with status $?"; status=1; }
}

echo "== driver"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || { echo "!! no nvidia-smi: no NVIDIA GPU here"; exit 1; }

# pip's CUDA wheels (nvidia-cuda-nvrtc, nvidia-cublas, nvidia-nccl-cu13, ...) keep their libraries
# in site-packages; the loader finds them once their folders are on LD_LIBRARY_PATH.
wheel_dirs=$(python3 - <<'PY' 2>/dev/null
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
dirs = {os.path.dirname(p) for r in roots for p in glob.glob(os.path.join(r, "nvidia", "**", "lib*.so*"), recursive=True)}
print(":".join(sorted(dirs)))
PY
)
export LD_LIBRARY_PATH="${wheel_dirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "== libraries"
for lib in libcuda.so.1 libnvrtc.so libcublas.so libnccl.so.2; do
    found=$( (ldconfig -p 2>/dev/null | awk -v l="$lib" '$1 ~ "^"l { print $NF; exit }'
        IFS=:; for d in $LD_LIBRARY_PATH; do ls "$d"/"$lib"* 2>/dev/null; done) | head -1)
    echo "$lib: ${found:-not found}"
done

step "bench device (GEMM, 50 steps CPU vs GPU)" "$out/medley" bench device --device cuda --steps 50
step "GPU tests (one-rank NCCL all-reduce, forwarding between device buffers)" \
    "$out/medley-gpu-tests" --ignored --nocapture --test-threads 1
step "bench compute on the GPU (one worker's step)" "$out/medley" bench compute --device cuda --threads 1 --rounds 1
exit $status

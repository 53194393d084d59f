#!/usr/bin/env bash
# All-reduce (float32 sum) side by side in one run: medley's communicator over shared memory,
# OpenMPI's MPI_Allreduce, and torch.distributed's Gloo when torch is installed. Same sizes,
# same method for all (warm-up batches of 1, 2, 4, ... calls until 50 ms are spent and at least
# 7 calls made (nccl-tests warms up with 5), then as many timed calls as the last batch says fit
# in 0.3 s, at most 10,000; the slowest rank's mean; busbw = algbw * 2(n-1)/n as nccl-tests), and
# the ratios. Each library binds its ranks as it
# does by default: mpirun one core per rank when there are enough, medley likewise. The
# libraries take turns for ROUNDS rounds (default 3) and each figure is the median over rounds,
# so a burst of other work on the machine does not land on one library only.
# Also medley's hierarchical two-domain all-reduce against the flat ring on the same ranks, with
# a bridge as fast as the domains (shared memory), a slower one (TCP over loopback) and a TCP
# bridge capped at BRIDGE_GB_S per link (default 0.5, about a tenth of what shared memory moves
# here), as a vendor-to-vendor path through host memory or a NIC is slower than either vendor's
# own links.
#
# Usage: [ROUNDS=3] [TORCH_PYTHON=python3] bench/comm_vs_mpi.sh [MAX_BYTES]
#   MAX_BYTES defaults to 64M; OpenMPI is installed if missing. Gloo runs when TORCH_PYTHON (a
#   Python interpreter) imports torch; PyPI's torch (with its CUDA libraries, ~5 GB) imports and
#   runs Gloo on a machine without a GPU:
#     python3 -m venv /tmp/torch && /tmp/torch/bin/pip install torch
#     TORCH_PYTHON=/tmp/torch/bin/python bench/comm_vs_mpi.sh
set -euo pipefail
cd "$(dirname "$0")/.."
max_bytes=${1:-64M}
rounds=${ROUNDS:-3}
bridge_gb_s=${BRIDGE_GB_S:-0.5}
torch_python=${TORCH_PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
    echo "installing OpenMPI (apt-get) ..." >&2
    apt-get update -qq >/dev/null && apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
fi
cargo build --release -q -p medley

python3 - "$max_bytes" > "$work/sizes" <<'PY'
import sys
text = sys.argv[1].upper()
shift = {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0)
top = int(text.rstrip("KMG")) << shift
size = 4096
while size <= top:
    print(size)
    size *= 4
PY

cat > "$work/allreduce.c" <<'C'
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
/* MPI_Allreduce of float sums, one line per size: bytes and the slowest rank's mean seconds. */
int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    for (int a = 1; a < argc; a++) {
        long bytes = atol(argv[a]);
        long count = bytes / 4;
        float *in = malloc(count * sizeof(float)), *out = malloc(count * sizeof(float));
        for (long i = 0; i < count; i++) in[i] = 1.0f;
        double warmed = 0, per_call = 0, t, mean, slowest;
        for (int batch = 1; (warmed < 0.05 || batch <= 5) && batch <= 10000; batch *= 2) {
            t = MPI_Wtime();
            for (int i = 0; i < batch; i++) MPI_Allreduce(in, out, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            mean = (MPI_Wtime() - t) / batch;
            MPI_Allreduce(&mean, &per_call, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            warmed += per_call * batch;
        }
        int iters = (int)(0.3 / (per_call > 1e-9 ? per_call : 1e-9));
        iters = iters < 1 ? 1 : iters > 10000 ? 10000 : iters;
        MPI_Barrier(MPI_COMM_WORLD);
        t = MPI_Wtime();
        for (int i = 0; i < iters; i++) MPI_Allreduce(in, out, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        mean = (MPI_Wtime() - t) / iters;
        MPI_Allreduce(&mean, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        int n;
        MPI_Comm_size(MPI_COMM_WORLD, &n);
        if (rank == 0) printf("%d %ld %.9f\n", n, bytes, slowest);
        free(in);
        free(out);
    }
    MPI_Finalize();
    return 0;
}
C
mpicc -O2 -o "$work/allreduce" "$work/allreduce.c"

cat > "$work/gloo.py" <<'PY'
import os, sys, time
import torch, torch.distributed as dist
import torch.multiprocessing as mp
def worker(rank, n, sizes, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    for size in sizes:
        t = torch.ones(size // 4)
        def calls(count):
            start = time.perf_counter()
            for _ in range(count): dist.all_reduce(t)
            mean = torch.tensor([(time.perf_counter() - start) / count], dtype=torch.float64)
            dist.all_reduce(mean, op=dist.ReduceOp.MAX)
            return mean.item()
        batch, warmed = 1, 0.0
        while (warmed < 0.05 or batch <= 5) and batch <= 10000:
            per_call = calls(batch); warmed += per_call * batch; batch *= 2
        iters = max(1, min(10000, int(0.3 / max(per_call, 1e-9))))
        dist.barrier()
        mean = torch.tensor([calls(iters)])
        if rank == 0:
            with open(out, "a") as f: f.write(f"{n} {size} {mean.item():.9f}\n")
    dist.destroy_process_group()
if __name__ == "__main__":
    n, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    sizes = [int(s) for s in sys.argv[4:]]
    mp.spawn(worker, args=(n, sizes, port, out), nprocs=n)
PY

: > "$work/mpi"; : > "$work/gloo"; : > "$work/medley.jsonl"
mapfile -t sizes < "$work/sizes"
for round in $(seq "$rounds"); do
    for n in 2 4; do
        echo "round $round: OpenMPI, $n ranks ..." >&2
        mpirun --allow-run-as-root --oversubscribe -np "$n" "$work/allreduce" "${sizes[@]}" >> "$work/mpi"
        if "$torch_python" -c "import torch" 2>/dev/null; then
            echo "round $round: Gloo, $n ranks ..." >&2
            "$torch_python" "$work/gloo.py" "$n" $((29600 + n)) "$work/gloo" "${sizes[@]}" 2> "$work/gloo.err" \
                || { cat "$work/gloo.err" >&2; exit 1; }
        fi
    done
    echo "round $round: medley ..." >&2
    # To a file first: a reader starting beside the ranks would take a core from one of them.
    ./target/release/medley bench comm --json --ops all-reduce --ranks 2,4 --setups shm,two-domain-shm-bridge,two-domain \
        --min-bytes 4K --max-bytes "$max_bytes" > "$work/medley.json"
    ./target/release/medley bench comm --json --ops all-reduce --ranks 2,4 --setups two-domain \
        --bridge-gb-s "$bridge_gb_s" --min-bytes 4K --max-bytes "$max_bytes" > "$work/medley-capped.json"
    python3 -c 'import json, sys; [print(json.dumps(r)) for f in sys.argv[1:] for r in json.load(open(f))]' \
        "$work/medley.json" "$work/medley-capped.json" >> "$work/medley.jsonl"
done

python3 - "$work" "$rounds" "$torch_python" "$bridge_gb_s" <<'PY'
import json, statistics, sys
work, rounds = sys.argv[1], sys.argv[2]
def medians(samples):
    return {key: statistics.median(values) for key, values in samples.items()}
def table(name):
    rows = {}
    for line in open(f"{work}/{name}"):
        n, size, seconds = line.split()
        rows.setdefault((int(n), int(size)), []).append(float(seconds))
    return medians(rows)
mpi, gloo = table("mpi"), table("gloo")
samples = {}
for line in open(f"{work}/medley.jsonl"):
    row = json.loads(line)
    setup = row["transport"] + ("-capped" if row.get("bridge_gbps") else "")
    key = (setup, row["algorithm"] if setup != "shm" else "auto")
    samples.setdefault(key, {}).setdefault((row["ranks"], row["bytes"]), []).append(row["time_us"] / 1e6)
medley = {key: medians(rows) for key, rows in samples.items()}
flat = medley[("shm", "auto")]
def busbw(n, size, seconds):
    return size / seconds / 1e9 * 2 * (n - 1) / n
print(f"all-reduce float32 sum, median of {rounds} rounds: time (us), busbw (GB/s); ratio > 1: medley is faster")
header = f"{'ranks':>5} {'bytes':>10} | {'medley us':>10} {'GB/s':>6} | {'OpenMPI us':>10} {'GB/s':>6} {'ratio':>6}"
header += f" | {'Gloo us':>10} {'GB/s':>6} {'ratio':>6}" if gloo else f" | Gloo: {sys.argv[3]} cannot import torch"
print(header)
for (n, size), seconds in sorted(flat.items()):
    line = f"{n:>5} {size:>10} | {seconds*1e6:>10.1f} {busbw(n, size, seconds):>6.2f}"
    for other in (mpi, gloo):
        if (n, size) in other:
            theirs = other[(n, size)]
            line += f" | {theirs*1e6:>10.1f} {busbw(n, size, theirs):>6.2f} {theirs/seconds:>6.2f}"
    print(line)
for setup, bridge in (("two-domain-shm-bridge", "a shared-memory bridge, as fast as the domains"),
                      ("two-domain", "a TCP bridge, slower than the domains' shared memory"),
                      ("two-domain-capped", f"a TCP bridge capped at {sys.argv[4]} GB/s per link")):
    hier, ring = medley.get((setup, "hierarchical"), {}), medley.get((setup, "ring"), {})
    print(f"\nmedley two-domain all-reduce with {bridge}: hierarchical vs flat ring")
    print(f"{'ranks':>5} {'bytes':>10} | {'hier us':>10} {'flat us':>10} {'hier/flat speed':>15}")
    for key in sorted(hier):
        if key in ring:
            print(f"{key[0]:>5} {key[1]:>10} | {hier[key]*1e6:>10.1f} {ring[key]*1e6:>10.1f} {ring[key]/hier[key]:>15.2f}")
PY

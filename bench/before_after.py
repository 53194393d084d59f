#!/usr/bin/env python3
"""Two medley builds side by side: bench plan, bench schedules and bench comm's 64 MiB all-reduce,
run in alternating rounds (so a burst of other work on a shared machine lands on both), each figure
the median over rounds, with after/before ratios.

Usage: bench/before_after.py BEFORE_BINARY AFTER_BINARY [ROUNDS]
  e.g. git worktree add /tmp/before REV && (cd /tmp/before && cargo build --release)
       cargo build --release && bench/before_after.py /tmp/before/target/release/medley target/release/medley 5
The communicator's figures swing by 2x between runs on a shared 2-core machine: use 5 rounds or more.
"""
import json, subprocess, statistics, sys
before, after, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 3
def run(binary, args):
    out = subprocess.run([binary] + args, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        sys.exit(f"{binary} {' '.join(args)} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)
results = {"before": {}, "after": {}}
def add(which, key, value):
    results[which].setdefault(key, []).append(value)
for r in range(rounds):
    for which, binary in (("before", before), ("after", after)) if r % 2 == 0 else (("after", after), ("before", before)):
        rows = run(binary, ["bench", "plan", "--json"])
        for row in rows:
            if row["table"] == "speed":
                add(which, f"plan {row['n_gpus']} GPUs: median s", row["median_s"])
                add(which, f"plan {row['n_gpus']} GPUs: peak RSS MiB", row["peak_rss_mib"])
        ratios = [row["uniform_ratio"] for row in rows if row["table"] == "quality" and row["uniform_ratio"]]
        add(which, "plan quality: best/uniform geomean", statistics.geometric_mean(ratios))
        sched = run(binary, ["bench", "schedules", "--json"])
        for row in sched["speed"]:
            add(which, f"schedules 1024-GPU step {'with' if row['timeline'] else 'no'} timeline: median s", row["median_s"])
            add(which, f"schedules 1024-GPU step {'with' if row['timeline'] else 'no'} timeline: events", row["events"])
        comm = run(binary, ["bench", "comm", "--json", "--min-bytes", "64M", "--max-bytes", "64M", "--ranks", "2,4",
                            "--setups", "shm", "--ops", "all-reduce"])
        for row in comm:
            add(which, f"comm all-reduce 64 MiB {row['ranks']} ranks shm: busbw GB/s", row["busbw_gbps"])
            add(which, f"comm all-reduce 64 MiB {row['ranks']} ranks shm: #wrong", row.get("wrong", 0))
        print(f"round {r + 1} {which} done", file=sys.stderr, flush=True)
print(f"| measure (median of {rounds} alternating rounds) | before | after | after/before |")
print("|---|---|---|---|")
for key in results["after"]:
    b = statistics.median(results["before"].get(key, [float("nan")]))
    a = statistics.median(results["after"][key])
    ratio = a / b if b else float("nan")
    print(f"| {key} | {b:.4g} | {a:.4g} | {ratio:.3f} |")

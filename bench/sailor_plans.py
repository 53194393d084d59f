"""Sailor's nine measured runs of its MIT cluster as medley plans and a measurements CSV.

Sailor (Strati et al., SOSP 2025) validated its simulator on plans it ran on three GPU types,
each stage's data-parallel replicas on nodes of different types; its repository keeps each plan
with the measured seconds an iteration (`real`) in sailor/Planner/simulations/validation/mit/.
This writes one medley plan per run into crates/medley-bench/data/sailor/ and the CSV that
`medley calibrate --measured` and `medley bench calibration` read:

    git clone https://github.com/eth-easl/sailor   # or a snapshot of it
    cargo build --release
    python3 bench/sailor_plans.py sailor target/release/medley

The job is the one Sailor's scripts run (ae_scripts/clariden_scripts/run_opt.slurm): OPT-350 as a
Megatron-DeepSpeed GPT (24 layers of 1024, 16 heads, 2,048 tokens), fp32 (no --fp16 or --bf16),
attention as batched matmuls (no --use-flash-attn), no activation checkpointing, DeepSpeed's
pipeline engine (1F1B, gradients all-reduced in fp32 after the last backward, no ZeRO). Sailor's
26 "layers" are the embedding, the 24 decoder layers and the head.
"""

import csv
import json
import pathlib
import subprocess
import sys

sailor, medley = pathlib.Path(sys.argv[1]), sys.argv[2]
runs_dir = sailor / "sailor/Planner/simulations/validation/mit"
out = pathlib.Path(__file__).resolve().parent.parent / "crates/medley-bench/data/sailor"
model_file = out / "opt-350.json"


def template(cluster: pathlib.Path, tp: int) -> dict:
    """A plan of this job on `cluster` as medley writes it: the cluster and model as plans hold them."""
    path = out / "template.json"
    # Full recomputation only to find a layout that fits: the plans keep every activation, as the
    # runs did, whatever medley's memory model says of them.
    job = ["--precision", "fp32", "--attention", "unfused", "--recompute", "full", "--no-zero1"]
    job += ["--no-overlap-grad-reduce", "--grad-reduce", "fp32", "--schedule", "1f1b"]
    job += ["--seq-len", "2048", "--global-batch", "256", "--micro-batch", "2", "--fix", f"tp={tp},pp=1,dp=1"]
    subprocess.run([medley, "plan", "--cluster", str(cluster), "--model", str(model_file), *job, "-o", str(path)],
                   check=True, capture_output=True)
    plan = json.loads(path.read_text())
    path.unlink()
    plan["model"]["name"] = "OPT-350 (Sailor's Megatron-DeepSpeed GPT)"
    plan["recompute"] = "none"
    return plan


def node_of(cluster: dict, device: str, taken: dict) -> list:
    """The devices of the next node of `device` type no stage holds yet."""
    first = 0
    for group in cluster["groups"]:
        per_node = group["gpus_per_node"]
        if group["device"]["name"] == device:
            idx = taken.get(device, 0)
            assert idx < group["n_nodes"], f"more {device} nodes than the cluster has"
            taken[device] = idx + 1
            start = first + idx * per_node
            return list(range(start, start + per_node))
        first += group["n_nodes"] * per_node
    raise KeyError(device)


def layers(sailor_layers: list) -> dict:
    """Sailor's layer indices (0 the embedding, 25 the head) as a range of decoder layers."""
    decoder = [layer - 1 for layer in sailor_layers if 1 <= layer <= 24]
    return {"start": min(decoder), "end": max(decoder) + 1}


HEADER = """\
# Sailor's measured runs of its MIT cluster (Strati et al., SOSP 2025, arXiv 2504.17096): seconds an
# iteration (`real`) of each plan in github.com/eth-easl/sailor sailor/Planner/simulations/
# validation/mit/, OPT-350 in fp32 on RTX 3090, Titan RTX and RTX 2080 Ti nodes. Written by
# bench/sailor_plans.py with the plans it names. Two runs (N3_D1, N6_D2) record the same
# seconds, 59.45533, to the digit; both are kept as published.
"""

NAMES = {"RTX-3090": "rtx-3090", "Titan-RTX": "titan-rtx", "RTX-2080": "rtx-2080-ti"}
rows = []
for path in sorted(runs_dir.glob("N*/plan_config_*.json")):
    run = json.loads(path.read_text())
    (pipeline,) = run["pipeline_list"]
    tps = {tp for stage in pipeline["tmp_per_stage"] for _, tp in stage}
    (tp,) = tps
    cluster = out / ("mit-2gpu-cluster.toml" if tp == 2 else "mit-cluster.toml")
    plan = template(cluster, tp)
    dp = pipeline["dp"][0]
    assert all(d == dp for d in pipeline["dp"]), "every stage as many replicas"
    taken: dict = {}
    stage_nodes = [[node_of(plan["cluster"], NAMES[gpus[0][0]], taken) for gpus, _ in stage]
                   for stage in pipeline["tmp_per_stage"]]
    ranges = [layers(stage) for stage in pipeline["layers_per_stage"]]
    boundary = {"kind": "native", "vendor": "nvidia"}
    plan["global_batch"], plan["micro_batch"] = run["gbs"], run["mbs"]
    plan["replicas"] = [
        {
            "n_micro_batches": run["gbs"] // (dp * run["mbs"]),
            "stages": [{"devices": stage_nodes[s][r], "layers": ranges[s]} for s in range(len(ranges))],
            "boundaries": [boundary] * (len(ranges) - 1),
        }
        for r in range(dp)
    ]
    plan["dp_groups"] = [{"layers": span, "route": boundary, "algorithm": "ring"} for span in ranges]
    name = f"mit-{path.stem.removeprefix('plan_config_')}.json"
    (out / name).write_text(json.dumps(plan, indent=1) + "\n")
    rows.append((f"validation/mit/{path.parent.name}/{path.name}", name, run["real"]))

assert rows, f"no plan_config_*.json under {runs_dir}"
with open(out / "mit.csv", "w", newline="") as f:
    f.write(HEADER)
    writer = csv.writer(f, lineterminator="\n")
    writer.writerow(["label", "plan", "step_s"])
    writer.writerows(rows)

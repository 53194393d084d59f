"""Megatron-LM's own argument parser and validation run on `medley export megatron --json`.

Megatron needs a GPU and Python 3.12 to import; this checks the arguments on a machine without
either, as a user's `pretrain_gpt.py` would read them:

    python3 -m venv venv && venv/bin/pip install torch numpy packaging
    git clone https://github.com/NVIDIA/Megatron-LM   # or a snapshot of it
    medley export megatron --plan plan.json --json > export.json
    CUDA_DEVICE_MAX_CONNECTIONS=1 venv/bin/python bench/megatron_args.py Megatron-LM export.json 9

The last argument is the plan's GPUs' compute capability major (9 Hopper, 8 Ampere, 7 Volta):
the one device query `validate_args` makes. It prints the settings that decide the model's math
as Megatron parsed them, or fails with Megatron's own error.
"""

import json
import sys
import types
import typing

import torch
import typing_extensions

megatron_dir, export_path, arch_major = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, megatron_dir)
typing.override = typing_extensions.override  # Megatron imports it from Python 3.12's typing
torch.cuda.get_device_properties = lambda *_: types.SimpleNamespace(major=arch_major, minor=0)

from megatron.training.arguments import parse_args, validate_args  # noqa: E402

export = json.load(open(export_path))
argv = []
for arg in export["args"]:
    argv.append(arg["flag"])
    if arg["value"] is not None:
        argv.extend(arg["value"].split(" "))
# What the export leaves to the user: tokenizer, data, optimizer, iterations.
user = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--mock-data", "--lr", "1e-4", "--train-iters", "10"]
sys.argv = ["pretrain_gpt.py"] + argv + user
args = parse_args()
args.world_size, args.rank = export["world_size"], 0
validate_args(args)
print(
    f"validated by Megatron: rotary_base {args.rotary_base}, use_rope_scaling {args.use_rope_scaling} "
    f"(factor {args.rope_scaling_factor}), layernorm_epsilon {args.layernorm_epsilon}, "
    f"padded_vocab_size {args.padded_vocab_size}, params_dtype {args.params_dtype}, "
    f"accumulate_allreduce_grads_in_fp32 {args.accumulate_allreduce_grads_in_fp32}"
)

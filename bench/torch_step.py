#!/usr/bin/env python3
"""medley's decoder in PyTorch, for `medley bench compute`: the same Llama-style layers (RMSNorm,
rotate-half RoPE, grouped-query causal attention, SwiGLU, untied embeddings), started from the
weights and trained on the tokens medley wrote, forward + cross-entropy + backward + AdamW per step.

Usage: TORCH_PYTHON/bin/python bench/torch_step.py INPUTS.safetensors THREADS STEPS
Prints one JSON object: {"first_loss": L, "step_s": [seconds per step, warm-up excluded]}.
INPUTS holds the parameters under medley's names, "tokens" and "targets" ([batch, seq], as
floats), and its metadata the model's shape and the optimizer's settings (see bench_compute.rs).
"""
import json, struct, sys, time

import numpy as np
import torch
import torch.nn.functional as F

WARM_UP = 2


def read_safetensors(path):
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        data = f.read()
    meta = header.pop("__metadata__", {})
    tensors = {}
    for name, info in header.items():
        assert info["dtype"] == "F32", f"{name}: {info['dtype']}"
        start, end = info["data_offsets"]
        tensors[name] = torch.from_numpy(np.frombuffer(data[start:end], dtype="<f4").reshape(info["shape"]).copy())
    return tensors, meta


def rms_norm(x, gain, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def forward(p, cfg, tokens, targets, cos, sin, mask):
    b, t = tokens.shape
    h, kv, eps = cfg["n_heads"], cfg["n_kv_heads"], cfg["norm_eps"]
    hd = cfg["hidden"] // h
    x = p["embed"][tokens]
    for layer in range(cfg["n_layers"]):
        w = lambda name: p[f"layers.{layer}.{name}"]
        a = rms_norm(x, w("attn_norm"), eps)
        q = rope((a @ w("wq")).view(b, t, h, hd), cos, sin).transpose(1, 2)
        k = rope((a @ w("wk")).view(b, t, kv, hd), cos, sin).transpose(1, 2)
        v = (a @ w("wv")).view(b, t, kv, hd).transpose(1, 2)
        k, v = k.repeat_interleave(h // kv, dim=1), v.repeat_interleave(h // kv, dim=1)
        scores = (q @ k.transpose(2, 3)) / hd**0.5
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        x = x + (probs @ v).transpose(1, 2).reshape(b, t, -1) @ w("wo")
        m = rms_norm(x, w("mlp_norm"), eps)
        x = x + (F.silu(m @ w("w_gate")) * (m @ w("w_up"))) @ w("w_down")
    logits = rms_norm(x, p["final_norm"], eps) @ p["lm_head"]
    return F.cross_entropy(logits.view(b * t, -1), targets.view(-1))


def main():
    path, threads, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(threads)
    tensors, meta = read_safetensors(path)
    cfg = json.loads(meta["config"])
    opt = json.loads(meta["adamw"])
    tokens, targets = tensors.pop("tokens").long(), tensors.pop("targets").long()
    params = {name: t.requires_grad_() for name, t in tensors.items()}
    seq, hd = tokens.shape[1], cfg["hidden"] // cfg["n_heads"]
    half = hd // 2
    freq = cfg["rope_theta"] ** (-(torch.arange(hd) % half).float() / half)
    angle = torch.arange(seq).float()[:, None] * freq[None, :]
    cos, sin = angle.cos()[None, :, None, :], angle.sin()[None, :, None, :]
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    decay = [t for n, t in params.items() if t.dim() > 1]
    no_decay = [t for n, t in params.items() if t.dim() <= 1]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": opt["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=opt["lr"], betas=(opt["beta1"], opt["beta2"]), eps=opt["eps"],
    )
    first_loss, times = None, []
    for step in range(WARM_UP + steps):
        started = time.perf_counter()
        loss = forward(params, cfg, tokens, targets, cos, sin, mask)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if first_loss is None:
            first_loss = loss.item()
        if step >= WARM_UP:
            times.append(time.perf_counter() - started)
    print(json.dumps({"first_loss": first_loss, "step_s": times, "torch": torch.__version__}))


if __name__ == "__main__":
    main()

"""The peer in the throughput benchmark: the reference PyTorch DiT (facebookresearch/DiT `models.py`, placed by the
user in `.ref/` for the run only) timed at our model's width, depth, heads, token count and batch, in a child
process started before JAX claims the GPU; and the cuDNN-against-XLA attention check.

    python -m reve_jax.tools.bench.peer '<spec json>'     # the child: prints its result row as one JSON line
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def peer_train_flops_per_image(width: int, depth: int, tokens: int, mlp_ratio: float, patch_in: int = 16) -> float:
    """Training FLOPs per image of the reference DiT (forward x3, matmuls only): per block q,k,v,out, QK^T and AV,
    the GELU MLP and adaLN; plus the patch embedding (p*p*C in), the final layer (2x out for learned sigma) and
    the time embedding. This is docs/recipe.md section 8's formula with the small terms added."""
    d, n = width, tokens
    block = 2 * n * 4 * d * d + 4 * n * n * d + 2 * n * 2 * d * int(mlp_ratio * d) + 2 * d * 6 * d
    extra = 2 * n * patch_in * d + 2 * n * d * 2 * patch_in + 2 * d * 2 * d + 2 * 256 * d + 2 * d * d
    return 3.0 * (depth * block + extra)


def bench_torch_peer(spec: dict) -> dict:
    """Time the reference PyTorch DiT (models.py of facebookresearch/DiT in spec['ref_dir']): AdamW, bf16 autocast
    on GPU, torch.compile, on a latent-shaped input with the same token count. `spec` holds width, depth, heads,
    mlp_ratio, grid (tokens per side), batch, warmup, steps, repeats, compile. Returns a result row."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, spec["ref_dir"])
    from models import DiT  # the reference implementation, brought in for the run only

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    if cuda:  # DiT's train.py turns TF32 on
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    side, b = 2 * spec["grid"], spec["batch"]
    model = DiT(
        input_size=side,
        patch_size=2,
        in_channels=4,
        hidden_size=spec["width"],
        depth=spec["depth"],
        num_heads=spec["heads"],
        mlp_ratio=spec["mlp_ratio"],
    ).to(dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0)
    x = torch.randn(b, 4, side, side, device=dev)
    t = torch.randint(0, 1000, (b,), device=dev)
    y = torch.randint(0, 1000, (b,), device=dev)
    target = torch.randn(b, 8, side, side, device=dev)
    fwd = torch.compile(model) if spec["compile"] else model
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step():
        with amp:
            loss = F.mse_loss(fwd(x, t, y).float(), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - t0  # torch.compile's tracing and code generation happen here
    for _ in range(max(spec["warmup"], 1)):
        step()
    sync()
    times = []
    for _ in range(spec["repeats"]):
        t0 = time.perf_counter()
        for _ in range(spec["steps"]):
            loss = step()
        sync()
        times.append((time.perf_counter() - t0) / spec["steps"])
    step_s = statistics.median(times)
    n = spec["grid"] ** 2
    row = {
        "model": spec["name"],
        "impl": "torch DiT" + (" compile" if spec["compile"] else " eager"),
        "batch": b,
        "tread": False,
        "step_s": step_s,
        "step_times": times,
        "images_per_s": b / step_s,
        "flops_per_image": peer_train_flops_per_image(spec["width"], spec["depth"], n, spec["mlp_ratio"]),
        "compile_s": first,
        "attention": "sdpa" if getattr(model.blocks[0].attn, "fused_attn", False) else "eager",
        "dtype": "bf16 autocast" if cuda else "float32",
        "loss": float(loss),
        "torch": torch.__version__,
    }
    if cuda:
        row["peak_bytes"], row["peak_mem_source"] = int(torch.cuda.max_memory_allocated()), "device"
    return row


def run_peer(cfg, opts) -> dict:
    """Run `bench_torch_peer` in a child process (so JAX and torch never share the GPU's memory) with the width,
    depth, heads, MLP ratio, image-token count and batch of `cfg`. Returns its row, or a row with `error`."""
    m = cfg.model
    spec = {
        "name": opts.name,
        "ref_dir": str(Path(opts.peer_ref).resolve()),
        "width": m.width,
        "depth": m.depth,
        "heads": m.heads,
        "mlp_ratio": m.mlp_ratio,
        "grid": cfg.data.image_size // m.patch,
        "batch": cfg.train.global_batch,
        "warmup": opts.warmup,
        "steps": opts.steps,
        "repeats": opts.repeats,
        "compile": opts.peer_compile,
    }
    base = {"model": opts.name, "impl": "torch DiT", "batch": spec["batch"], "tread": False}
    if not (Path(spec["ref_dir"]) / "models.py").is_file():
        return dict(base, error=f"no models.py in {spec['ref_dir']} (fetch facebookresearch/DiT into .ref/)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "reve_jax.tools.bench.peer", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=opts.peer_timeout)
    except subprocess.TimeoutExpired:
        return dict(base, error=f"timed out after {opts.peer_timeout}s")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return dict(base, error=f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-2000:]}")
    return json.loads(lines[-1])


def attention_check(batch: int = 4, seq: int = 272, heads: int = 16, head_dim: int = 72, seed: int = 0) -> dict:
    """cuDNN against XLA attention on random bf16 inputs with per-sample key lengths: relative errors of the output
    and of the gradients of q, k, v (each against a float32 XLA reference). Raises where cuDNN is unavailable."""
    import jax  # here, not at the top: the torch child never imports JAX
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (jax.random.normal(kk, (batch, seq, heads, head_dim), jnp.float32) for kk in keys[:3])
    lengths = jax.random.randint(keys[3], (batch,), seq // 2, seq + 1).astype(jnp.int32)
    cot = jax.random.normal(jax.random.key(seed + 1), q.shape, jnp.float32)

    def run(impl, dtype):
        def f(q, k, v):
            out = jax.nn.dot_product_attention(
                q.astype(dtype), k.astype(dtype), v.astype(dtype), key_value_seq_lengths=lengths, implementation=impl
            )
            return jnp.sum(out.astype(jnp.float32) * cot), out

        (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return [out, *grads]

    ref = run("xla", jnp.float32)
    result = {}
    for impl in ("xla", "cudnn"):
        got = run(impl, jnp.bfloat16)
        for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
            err = jnp.linalg.norm(a.astype(jnp.float32) - r) / jnp.linalg.norm(r)
            result[f"{impl}_bf16_{name}_rel_err"] = float(err)
    return result


if __name__ == "__main__":
    print(json.dumps(bench_torch_peer(json.loads(sys.argv[1]))), flush=True)

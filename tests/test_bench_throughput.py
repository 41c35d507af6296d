"""The throughput benchmark runs end to end on a tiny config and prints its table; the layer changes it measures
(q,k,v and gate,up as one stacked GEMM, the cuDNN-to-XLA attention fallback) keep the numerics."""

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from util import load_script

from reve_jax import flops
from reve_jax.model import layers
from reve_jax.tools.bench import peer, throughput

EXPECTED_COLUMNS = [
    "model",
    "impl",
    "batch",
    "tread",
    "img/s",
    "step ms",
    "TFLOP/s",
    "MFU",
    "compile s",
    "peak GiB",
    "data wait",
    "ckpt block s",
]


def _table_rows(text: str) -> list[dict]:
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == EXPECTED_COLUMNS
    assert set(lines[1]) <= set("|-")
    return [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")), strict=True)) for ln in lines[2:]]


def test_benchmark_runs_two_steps_and_prints_the_table(capsys, tmp_path):
    results = tmp_path / "out" / "results.jsonl"
    argv = ["--preset", "tiny", "--steps", "2", "--repeats", "1", "--warmup", "1", "--data-steps", "2"]
    rows = throughput.main([*argv, "--out", str(results.parent), "--ckpt-dir", str(tmp_path), "--label", "test"])
    table = _table_rows(capsys.readouterr().out)
    assert len(rows) == 1 and len(table) == 1
    cells, row = table[0], rows[0]
    assert (cells["model"], cells["impl"], cells["batch"], cells["tread"]) == ("tiny", "reve_jax test", "8", "off")
    assert float(cells["img/s"].replace(",", "")) > 0 and float(cells["step ms"]) > 0
    # The cell has one decimal: a tiny model on loaded cores can print 0.0%; the row holds the value itself.
    assert 0 < row["mfu"] < 1 and float(cells["MFU"].rstrip("%")) == round(100 * row["mfu"], 1)
    assert float(cells["compile s"]) > 0
    assert cells["data wait"].endswith("%") and 0 <= float(cells["data wait"].rstrip("%")) <= 100
    assert float(cells["ckpt block s"]) >= 0
    # The numbers behind the cells are consistent with each other and with the FLOP counter.
    cfg = throughput.load_bench_config("tiny", None, None, False)
    assert row["flops_per_image"] == flops.train_flops_per_image(cfg)
    assert row["images_per_s"] == pytest.approx(8 / row["step_s"])
    assert row["tflops"] == pytest.approx(row["flops_per_image"] * row["images_per_s"] / 1e12)
    assert math.isfinite(row["loss"]) and row["memory"]["estimate"] > 0
    assert row["ckpt_finish_s"] >= 0 and not list(tmp_path.glob("run"))  # the checkpoint was cleaned up
    assert [json.loads(x)["images_per_s"] for x in results.read_text().splitlines()] == [row["images_per_s"]]


def test_tread_row_counts_fewer_flops():
    on = throughput.load_bench_config("dit-xl2", None, 256, True)
    off = throughput.load_bench_config("dit-xl2", None, 256, False)
    assert (off.data.image_size // off.model.patch) ** 2 == 256 and off.train.global_batch == 256
    assert flops.train_flops_per_image(on) < 0.7 * flops.train_flops_per_image(off)


def test_peer_flops_match_the_recipe_formula():
    # docs/recipe.md section 8: 3 * L * (24*N*d^2 + 4*N^2*d) for DiT-XL/2, 601 img/s = 43% of 989 TFLOP/s.
    core = 3 * 28 * (24 * 256 * 1152**2 + 4 * 256**2 * 1152)
    got = peer.peer_train_flops_per_image(1152, 28, 256, 4.0)
    assert core < got < 1.02 * core
    assert 601 * got / 1e12 / 989 == pytest.approx(0.43, abs=0.01)


STAND_IN_DIT = """
import torch


class _Attn(torch.nn.Module):
    fused_attn = True


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = _Attn()


class DiT(torch.nn.Module):  # the reference's constructor and call, a patchify-linear-unpatchify body
    def __init__(self, input_size, patch_size, in_channels, hidden_size, depth, num_heads, mlp_ratio):
        super().__init__()
        self.p, self.c = patch_size, in_channels
        self.blocks = torch.nn.ModuleList([_Block()])
        self.lin = torch.nn.Linear(patch_size * patch_size * in_channels, 2 * patch_size * patch_size * in_channels)

    def forward(self, x, t, y):
        b, c, h, w = x.shape
        p = self.p
        tokens = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).reshape(b, -1, p * p * c)
        out = self.lin(tokens).reshape(b, h // p, w // p, p, p, 2 * c).permute(0, 5, 1, 3, 2, 4)
        return out.reshape(b, 2 * c, h, w)
"""


def test_peer_runs_in_a_child_process_and_reports_a_row(tmp_path):
    """The peer's child process (python -m reve_jax.tools.bench.peer) with a stand-in for the reference models.py."""
    (tmp_path / "models.py").write_text(STAND_IN_DIT)
    cfg = throughput.load_bench_config("tiny", None, 4, False)
    opts = argparse.Namespace(
        name="tiny", peer_ref=str(tmp_path), warmup=1, steps=2, repeats=1, peer_compile=False, peer_timeout=120
    )
    row = peer.run_peer(cfg, opts)
    assert "error" not in row, row.get("error")
    grid = cfg.data.image_size // cfg.model.patch
    assert row["impl"] == "torch DiT eager" and row["batch"] == 4 and row["images_per_s"] > 0
    assert row["flops_per_image"] == peer.peer_train_flops_per_image(
        cfg.model.width, cfg.model.depth, grid**2, cfg.model.mlp_ratio
    )
    missing = peer.run_peer(cfg, argparse.Namespace(**dict(vars(opts), peer_ref=str(tmp_path / "none"))))
    assert "no models.py" in missing["error"]


def test_table_marks_errors_and_estimated_memory():
    ok = {"model": "m", "impl": "x", "batch": 4, "tread": True, "images_per_s": 100.0, "step_s": 0.04}
    ok.update(flops_per_image=1e12, compile_s=1.0, peak_bytes=2**31, peak_mem_source="xla")
    text = throughput.format_table([throughput.add_rates(ok, 1000.0, 1), {**ok, "error": "boom"}])
    a, b = _table_rows(text)
    assert a["peak GiB"] == "2.0*" and a["MFU"] == "10.0%" and a["TFLOP/s"] == "100.0"
    assert b["img/s"] == "error"


def _linears(n, din=24, dout=16, dtype=jnp.float32):
    rngs = nnx.Rngs(0)
    with nnx.use_eager_sharding(False):
        out = [layers.dense(din, dout, (None, None), rngs, dtype=dtype, param_dtype=jnp.float32) for _ in range(n)]
    for i, lin in enumerate(out):
        lin.bias[...] = jax.random.normal(jax.random.key(i), lin.bias.shape)
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_stacked_projection_equals_separate_layers(dtype):
    lins = _linears(3, dtype=dtype)
    x = jax.random.normal(jax.random.key(9), (2, 5, 24))
    y = layers.stacked_projection(x, tuple(lins))
    assert y.shape == (2, 5, 3, 16) and y.dtype == dtype
    # One GEMM may block the sum differently from three: equal up to rounding in the compute dtype.
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    for j, lin in enumerate(lins):
        np.testing.assert_allclose(
            np.asarray(y[:, :, j], np.float32), np.asarray(lin(x), np.float32), rtol=tol, atol=tol
        )


def test_swiglu_is_the_plain_formula():
    with nnx.use_eager_sharding(False):
        mlp = layers.SwiGLU(24, 40, rngs=nnx.Rngs(1), dtype=jnp.float32, param_dtype=jnp.float32)
    x = jax.random.normal(jax.random.key(2), (3, 7, 24))
    want = mlp.down(jax.nn.silu(mlp.gate(x)) * mlp.up(x))
    np.testing.assert_allclose(np.asarray(mlp(x)), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_auto_attention_falls_back_to_xla_when_cudnn_refuses(monkeypatch):
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 8, 2, 8), jnp.bfloat16) for i in range(3))
    lengths = jnp.asarray([3, 8], jnp.int32)
    want = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, implementation="xla")
    assert layers.attention_impl("auto", jnp.bfloat16, 8) == ("cudnn" if jax.default_backend() == "gpu" else "xla")
    assert layers.attention_impl("auto", jnp.float32, 8) == "xla"
    assert layers.attention_impl("auto", jnp.bfloat16, 12) == "xla"
    if jax.default_backend() == "gpu":
        pytest.skip("cuDNN is present: the refusal cannot be provoked this way")
    # Force 'auto' to pick cuDNN where there is none: JAX refuses while tracing, and 'auto' means XLA then.
    monkeypatch.setattr(layers, "attention_impl", lambda name, dtype=None, head_dim=None: "cudnn")
    got = layers.dot_product_attention(q, k, v, lengths, "auto")
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(RuntimeError):  # an explicit choice is never replaced
        layers.dot_product_attention(q, k, v, lengths, "cudnn")


def test_host_bench_reports_input_rate_and_save_blocking(tmp_path, capsys):
    script = load_script("bench_host")
    out = tmp_path / "host.jsonl"
    (row,) = script.host.main(
        ["input", "--preset", "tiny", "--batch", "8", "--batches", "2", "--repeats", "2", "--out", str(tmp_path),
         "--config.data.worker_threads=1"]
    )  # fmt: skip
    assert row["images_per_s"] > 0 and len(row["runs"]) == 2 and row["threads"] == 1 and row["image_size"] == 16
    plain, staged = script.host.main(["ckpt", "--gb", "0.004", "--leaves", "4", "--out", str(tmp_path)])
    assert plain["what"] == "ckpt" and staged["what"] == "ckpt staged" and plain["gb"] == pytest.approx(0.004)
    assert 0 < plain["blocking_s"] <= plain["total_s"] and 0 < staged["stage_s"] <= staged["blocking_s"]
    assert len(out.read_text().splitlines()) == 3 and "img/s" in capsys.readouterr().out

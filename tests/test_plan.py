"""The memory plan: state bytes from abstract shardings on meshes of any size, the activation formula, the
check against XLA's compiled memory analysis on 8 CPU devices, and the search for what fits."""

import jax
import pytest
from util import load_script, tiny_config

from reve_jax import config, sharding
from reve_jax.tools.plan import memory
from reve_jax.train import train_state

MIB = 2**20


def test_state_bytes_on_an_abstract_mesh_larger_than_the_devices():
    cfg = tiny_config(  # AdamW: its state is two moments per parameter, checked below
        "model.width=64",
        "model.heads=2",
        "mesh.fsdp=16",
        "mesh.tensor=8",
        "train.global_batch=16",
        "optim.name='adamw'",
    )
    p, sizer = memory.plan(cfg, 128)
    assert p.mesh == {"data": 1, "fsdp": 16, "tensor": 8} and len(jax.devices()) < 128
    full = sum(memory.leaf_bytes(a) for a in jax.tree.leaves(sizer.abstract["params"]))
    # The big matrices shard 128 ways; small vectors (norm scales, biases) may stay replicated.
    assert full / 128 <= p.state["params"] < full / 8
    assert p.state["ema"] == p.state["params"] and p.state["opt_state"] == pytest.approx(2 * p.state["params"], 0.01)
    # The sizer (used by the search) agrees with make_setup's own shardings for the configured mesh.
    assert sizer.bytes_for((1, 16, 8)) == p.state


def test_activation_formula_responds_to_remat_accumulation_tensor_and_attention():
    cfg = tiny_config("model.width=256", "model.heads=4", "model.depth=4")
    act = lambda **kw: memory.activation_bytes(cfg, **{"micro_batch": 4, "tensor": 1, "remat": "none", **kw})
    base = act(flash=False)["total"]
    assert act(flash=False, remat="block")["total"] < 0.6 * base
    assert act(flash=False, micro_batch=2)["total"] == pytest.approx(base / 2)
    assert act(flash=False, tensor=2)["total"] < base
    assert act(flash=True)["total"] < base


def test_plan_matches_compiled_memory_on_8_cpu_devices():
    cfg = tiny_config("model.width=256", "model.heads=4", "mesh.fsdp=4", "train.global_batch=32")
    mesh = sharding.make_mesh(cfg.mesh)
    assert mesh.size == 8
    compiled = memory.compiled_memory(cfg, mesh)
    p, _ = memory.plan(cfg, 8, flash=False)  # CPU runs XLA's attention
    arrays = p.state["params"] + p.state["opt_state"] + p.state["ema"]
    assert arrays > 0.9 * compiled["argument"]  # the state dominates the step's arguments
    assert arrays == pytest.approx(compiled["argument"], rel=0.10)
    # Activations and temporaries are an estimate: docs/planning.md gives the bound and the measured ratios.
    assert 0.67 < p.total / compiled["total"] < 1.5, (p.total / MIB, compiled)


def test_a_plan_that_does_not_fit_says_what_would(capsys):
    overrides = ["--config.train.global_batch=64"]
    cfg = config.load_config("configs/tiny.py", overrides)  # as scripts/plan.py loads it
    roomy, sizer = memory.plan(cfg, 8)  # data=8: the state is replicated on every device
    budget = int(0.7 * roomy.total)
    tight = memory.plan_for(sizer, 8, (8, 1, 1), 1, "none", budget)
    assert not tight.fits
    fit = memory.cheapest_fit(sizer, 8, budget)
    assert fit is not None and fit.fits and fit.total <= budget
    assert (fit.mesh, fit.grad_accum, fit.remat) != (tight.mesh, 1, "none")
    costs = [p.cost for p in memory.search(sizer, 8, budget)]
    assert costs == sorted(costs)

    gib = budget / 0.9 / memory.GIB
    load_script("plan").main(["--config", "configs/tiny.py", "--devices", "8", "--gpu-mem-gib", str(gib), *overrides])
    text = capsys.readouterr().out
    assert "DOES NOT FIT" in text and f"would fit with: {memory.overrides_for(fit)}" in text


def test_state_sizer_counts_one_block_in_either_layout():
    """The activation-memory formula needs one block's weights: the same with model.scan_layers' stacked blocks."""
    counts = []
    for scan in (False, True):
        cfg = tiny_config("model.depth=3", f"model.scan_layers={scan}")
        setup = train_state.make_setup(cfg, sharding.make_mesh(cfg.mesh))
        counts.append(memory.StateSizer(setup).block_params)
    assert counts[0] == counts[1] > 0

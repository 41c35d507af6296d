"""Sharding: a golden file of every parameter's PartitionSpec and optimizer group, and a step on 8 devices equal
to the same step on 1 device."""

import os
from pathlib import Path

import jax
import numpy as np
import pytest
from util import tiny_config

from reve_jax import optim, sharding
from reve_jax.train import builder, train_state

GOLDEN = Path(__file__).parent / "golden" / "partition_specs.txt"
MESH = ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")


def _golden_text(setup) -> str:
    specs = sharding.describe_shardings(setup.state_shardings["params"]).splitlines()
    groups = [label for _, label in jax.tree_util.tree_flatten_with_path(setup.param_labels)[0]]
    return "\n".join(f"{s}\t{g}" for s, g in zip(specs, groups, strict=True)) + "\n"


def test_partition_specs_and_optimizer_groups_match_golden_file():
    cfg = tiny_config(*MESH, "optim.name='muon'", "model.width=64", "model.heads=4")
    setup = train_state.make_setup(cfg, sharding.make_mesh(cfg.mesh))
    text = _golden_text(setup)
    if os.environ.get("REVE_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "regenerate with REVE_UPDATE_GOLDEN=1 after an intended change"
    # Spot checks that do not depend on the file.
    p = setup.state_shardings["params"]
    assert tuple(p["blocks"][0]["attn"]["q"]["kernel"].spec) == ("fsdp", "tensor")
    assert tuple(p["blocks"][0]["mlp"]["down"]["kernel"].spec) == ("tensor", "fsdp")
    labels = setup.param_labels
    assert labels["blocks"][1]["mlp"]["gate"]["kernel"] == "muon"
    assert labels["blocks"][1]["adaln"]["kernel"] == "adamw"
    assert labels["patch_embed"]["proj_out"]["kernel"] == "adamw"


def test_optimizer_state_follows_parameter_sharding():
    cfg = tiny_config(*MESH, "model.width=64", "model.heads=4")
    setup = train_state.make_setup(cfg, sharding.make_mesh(cfg.mesh))
    q = setup.state_shardings["params"]["blocks"][0]["attn"]["q"]["kernel"]
    specs = {str(s.spec) for s in jax.tree.leaves(setup.state_shardings["opt_state"])}
    assert str(q.spec) in specs
    assert optim.describe_param_groups(setup.abstract_state["params"], setup.param_labels)


def _one_step(cfg, devices, batch):
    run = builder.build(cfg, sharding.make_mesh(cfg.mesh, devices))
    state = run.init_state()
    gbatch = run.to_device(batch)
    state, metrics = run.step(state, gbatch)
    state, metrics = run.step(state, gbatch)
    return jax.device_get(state), jax.device_get(metrics)


@pytest.mark.parametrize("layout", [(), ("model.scan_layers=True",)], ids=["unrolled", "scan"])
def test_step_on_8_devices_equals_step_on_1_device(layout):
    cfg8 = tiny_config(*MESH, "model.width=64", "model.heads=4", "optim.name='muon'", *layout)
    cfg1 = tiny_config("model.width=64", "model.heads=4", "optim.name='muon'", *layout)
    batch = next(builder.build(cfg8).host_batches(0))
    s8, m8 = _one_step(cfg8, jax.devices(), batch)
    s1, m1 = _one_step(cfg1, jax.devices()[:1], batch)
    np.testing.assert_allclose(m8["loss"], m1["loss"], rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(s8)[0], jax.tree.leaves(s1), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5, err_msg=jax.tree_util.keystr(path))

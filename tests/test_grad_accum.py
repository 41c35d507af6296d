"""Gradient accumulation (train.grad_accum): a step over 2 micro-batches is one optimizer step on the mean
gradient of the whole global batch, the same step as without accumulation (three steps compared)."""

import jax
import numpy as np
from util import tiny_config

from reve_jax.train import builder

# Noise-free flow matching: every sample at the same t (logit-normal with zero spread), no noise (z = t x), no
# caption dropped. The loss is then a plain function of the weights and the batch, so the accumulated step can
# be compared with the full-batch step number for number (with noise, each micro-batch draws its own).
DETERMINISTIC = ("diffusion.t_std=0.0", "diffusion.noise_scale=0.0", "diffusion.caption_drop=0.0")


def _one_step(*overrides):
    cfg = tiny_config(*DETERMINISTIC, "train.global_batch=16", "optim.warmup_steps=0", *overrides)
    run = builder.build(cfg)
    state = run.init_state()
    init = jax.device_get(state["params"])
    batches = run.batches(0)
    metrics = []
    for _ in range(3):  # zero-initialised outputs, then gates: by the third step the gradient reaches every block
        state, m = run.step(state, next(batches))
        metrics.append(jax.device_get(m))
    return init, jax.device_get(state), metrics


def test_two_micro_batches_make_the_full_batch_step():
    init, full, m_full = _one_step()
    _, accum, m_accum = _one_step("train.grad_accum=2")
    assert int(full["step"]) == int(accum["step"]) == 3
    # The same losses and gradient norms: the mean over both halves, not their sum nor one half's.
    for a, b in zip(m_accum, m_full, strict=True):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-5)
        assert b["grad_norm"] > 0
    leaves = jax.tree_util.tree_flatten_with_path(full["params"])[0]
    moved = 0
    for (path, a), b, c in zip(leaves, jax.tree.leaves(accum["params"]), jax.tree.leaves(init), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
        moved += not np.array_equal(a, c)
    assert moved > len(leaves) // 2, (moved, len(leaves))  # the steps reached the weights
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(full["opt_state"])[0], jax.tree.leaves(accum["opt_state"]), strict=True
    ):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))

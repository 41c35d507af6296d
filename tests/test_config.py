"""Configs: every key declared once, overrides typed, impossible combinations rejected before compiling."""

import json
import os
import subprocess
import sys

import pytest
from util import xla_flags

from reve_jax import flops
from reve_jax.config import ConfigError, apply_override, load_config
from reve_jax.sharding import MeshError, make_mesh, mesh_shape

CONFIGS = ["configs/tiny.py", "configs/jit_b16.py", "configs/prx_1b.py"]


@pytest.mark.parametrize("path", CONFIGS)
def test_experiment_configs_load_and_validate(path):
    cfg = load_config(path)
    assert cfg.model.width % cfg.model.heads == 0
    assert cfg.data.image_size % cfg.model.patch == 0


@pytest.mark.parametrize("path", ["configs/recipe/baseline.py", "configs/recipe/full.py"])
@pytest.mark.parametrize("size", ["tiny", "jit_b16", "prx_1b", "tiny,jit,bottleneck,tread,muon,ddt"])
def test_recipe_configs_load_and_validate_at_every_size(path, size):
    """Loading validates; test_recipe.py trains each path (baseline, DiT recipe, DDT recipe) at test size."""
    cfg = load_config(f"{path}:{size}")
    base = load_config(f"configs/{size.split(',')[0]}.py")
    assert (cfg.model.width, cfg.model.depth, cfg.data.image_size) == (
        base.model.width, base.model.depth, base.data.image_size,
    )  # fmt: skip
    assert (cfg.optim.name == "muon") == (path.endswith("full.py") or "muon" in size)


def test_named_sizes_match_the_recipe():
    jit_b = load_config("configs/jit_b16.py")
    assert (jit_b.model.depth, jit_b.model.width, jit_b.model.heads, jit_b.model.patch) == (12, 768, 12, 16)
    assert (jit_b.data.image_size, jit_b.model.bottleneck) == (256, 128)
    prx = load_config("configs/prx_1b.py")
    assert (prx.model.width, prx.model.depth, prx.model.heads, prx.model.patch) == (1792, 16, 28, 32)
    assert (prx.model.bottleneck, prx.data.image_size) == (256, 512)
    assert flops.swiglu_hidden(1792, prx.model.mlp_ratio, prx.model.mlp_multiple_of) == 6272  # 3.5 x width


def test_override_sets_typed_value():
    cfg = load_config(
        "configs/tiny.py",
        ["--config.model.depth=3", "--config.optim.name=muon", "--config.sample.cfg_interval=(0.1, 0.9)"],
    )
    assert cfg.model.depth == 3 and cfg.optim.name == "muon" and cfg.sample.cfg_interval == (0.1, 0.9)


@pytest.mark.parametrize(
    "override, message",
    [
        ("--config.model.depht=3", "unknown config key 'model.depht'"),
        ("--config.modle.depth=3", "unknown config section 'modle'"),
        ("--config.model.depth=deep", "expects int"),
        ("--config.model.heads=5", "does not divide model.width"),
        ("--config.model.patch=5", "not divisible by model.patch"),
        ("--config.optim.name=sgd", "optim.name='sgd' is not one of"),
        ("--config.model.route.keep_ratio=1.5", "keep_ratio"),
        ("--config.train.grad_accum=3", "multiple of train.grad_accum"),
        ("--config.sample.t_eps=-0.1", "sample.t_eps=-0.1 must lie in"),
        ("model.depth", "must look like"),
    ],
)
def test_bad_config_is_a_clear_error(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config("configs/tiny.py", [override])


def test_experiment_file_cannot_add_keys(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from configs import base\n\ndef get_config():\n    c = base.get_config()\n"
        "    c.model.dpeth = 3\n    return c\n"
    )
    with pytest.raises(ConfigError, match="dpeth"):
        load_config(str(bad))


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.py")


def test_mesh_that_does_not_fit_is_a_clear_error():
    cfg = load_config("configs/tiny.py", ["--config.mesh.fsdp=3"])
    with pytest.raises(MeshError, match="does not fit 8 devices"):
        make_mesh(cfg.mesh)
    cfg = load_config("configs/tiny.py", ["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=1"])
    with pytest.raises(MeshError, match="needs 4 devices but 8"):
        make_mesh(cfg.mesh)
    assert mesh_shape({"data": -1, "fsdp": 2, "tensor": 2}, 8) == (2, 2, 2)


def test_train_script_reports_bad_key_before_compiling(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/train.py",
            "--config",
            "configs/tiny.py",
            "--workdir",
            str(tmp_path / "w"),
            "--config.model.widht=64",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "unknown config key 'model.widht'" in proc.stderr
    assert not (tmp_path / "w" / "checkpoints").exists()


def test_apply_override_rejects_wrong_tuple_type():
    cfg = load_config("configs/tiny.py")
    with pytest.raises(ConfigError):
        apply_override(cfg, "sample.steps='many'")


def _leaves(node, prefix=""):
    for k, v in node.items():
        if hasattr(v, "items"):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


def test_every_base_key_is_read_by_the_code():
    """A key nothing reads is a knob that does nothing: each leaf of configs/base.py must be read somewhere in the
    package (attribute or item access by its name), validation in config.py not counting."""
    import re
    from pathlib import Path

    from configs import base

    root = Path(__file__).resolve().parents[1] / "reve_jax"
    src = "\n".join(p.read_text() for p in root.rglob("*.py") if p.name != "config.py")
    unread = [
        key
        for key in _leaves(base.get_config())
        if not re.search(rf"\.{key.split('.')[-1]}\b|\[[\"']{key.split('.')[-1]}[\"']\]", src)
    ]
    assert not unread, f"config keys nothing reads: {unread}"
    assert "model.text_rope" not in set(_leaves(base.get_config()))


def test_choices_are_declared_once():
    """The allowed values of a choice key live in config.CHOICES; the modules that check them import it."""
    from reve_jax import config, diffusion, optim

    assert optim.OPTIMIZERS is config.CHOICES["optim.name"]
    assert optim.SCHEDULES is config.CHOICES["optim.schedule"]
    with pytest.raises(ValueError, match="sample.sampler='rk4' is not one of"):
        diffusion.sample(lambda z, t: z, __import__("numpy").zeros((1, 4, 4, 3), "float32"), 2, "rk4")


def test_global_batch_that_does_not_split_is_one_line_before_compiling(tmp_path):
    """8 devices, batch 12: a one-line error naming the key, exit status non-zero, no traceback, nothing traced."""
    proc = subprocess.run(
        [sys.executable, "scripts/train.py", "--config", "configs/tiny.py", "--workdir", str(tmp_path / "w"),
         "--config.train.global_batch=12"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "XLA_FLAGS": xla_flags(8), "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert proc.returncode != 0
    assert "train.global_batch=12 must split evenly over 8 data-parallel devices" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "w" / "checkpoints").exists()


def test_config_files_in_subfolders_load_without_sys_path(tmp_path):
    """configs/speedup/*.py and configs/bench/*.py import `configs...`: the loader registers the configs folder
    that holds the file, so they load from any working directory and sys.path stays as it was."""
    code = (
        "import sys; before = list(sys.path); from reve_jax.config import load_config; "
        "c = load_config('{root}/configs/speedup/cpu.py:baseline'); "
        "b = load_config('{root}/configs/bench/dit_b2.py'); "
        "assert sys.path == before; print(c.diffusion.prediction, c.model.patch, b.model.width)"
    ).format(root=__import__("pathlib").Path(__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["v", "8", "768"]


def test_a_saved_config_that_predates_a_key_reads_back_as_it_trained():
    # A run saved before a key existed must sample, score and resume as it trained: the key comes back with the
    # value it trained under (config.ADDED_KEYS), not the new default, and resuming it is not refused.
    from reve_jax import config
    from reve_jax.train import trainer

    base = load_config("configs/tiny.py")
    flat = {}
    for dotted, legacy in config.ADDED_KEYS.items():
        *parents, leaf = dotted.split(".")
        node = base
        for part in parents:
            node = node[part]
        assert leaf in node, f"ADDED_KEYS names {dotted}, which configs/base.py does not have"
        assert type(node[leaf]) is type(legacy), f"{dotted}: {legacy!r} is not of the key's type"
        flat[dotted] = legacy
    saved = json.loads(config.to_json(base))
    for dotted in flat:
        *parents, leaf = dotted.split(".")
        node = saved
        for part in parents:
            node = node[part]
        del node[leaf]
    text = json.dumps(saved)
    old = config.from_json(text)
    for dotted, legacy in flat.items():
        section, *rest = dotted.split(".")
        value = old[section]
        for part in rest:
            value = value[part]
        assert value == legacy, dotted
    assert base.model.pos_embed != "none"  # the tiny config now differs from the old run...
    with pytest.raises(Exception, match="model.pos_embed: saved 'none', now 'sincos'"):
        trainer.check_compatible(base, text)  # ...and resuming the old run under it says so
    with base.unlocked():
        base.model.pos_embed = "none"
        base.model.text_stream = "joint"  # configs/tiny.py's other model key that differs from its legacy value
    trainer.check_compatible(base, text)  # the same model: the missing keys are not a difference

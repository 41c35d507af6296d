"""Loading, overriding and validating configs.

A config file is a Python module with `get_config(arg=None)` that starts from configs/base.py. The base config
is locked, so an experiment file or a `--config.a.b=value` override that names an unknown key fails, and
ml_collections' typed fields reject a value of the wrong type. `validate` then checks combinations, all before
anything is compiled.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import sys
from pathlib import Path

import ml_collections

CHOICES = {
    "model.arch": ("dit", "ddt"),
    "model.pos_embed": ("none", "sincos"),
    "model.attention": ("auto", "xla", "cudnn"),
    "model.remat": ("none", "block", "dots"),
    "model.text_stream": ("joint", "fixed"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.param_dtype": ("float32", "bfloat16"),
    "text.encoder": ("builtin", "precomputed"),
    "data.name": ("synthetic", "shards"),
    "data.render": ("jitter", "fixed"),
    "latent.train_render": ("", "jitter", "fixed"),
    "diffusion.prediction": ("x", "v", "eps"),
    "diffusion.loss_space": ("x", "v", "eps"),
    "diffusion.t_sampler": ("logit_normal", "uniform"),
    "optim.name": ("adamw", "muon"),
    "loss.perceptual_dtype": ("float32", "bfloat16"),
    "loss.repa_target": ("dinov2", "features"),
    "loss.dino_target": ("dinov2", "features"),
    "optim.schedule": ("constant", "cosine", "linear", "wsd"),
    "optim.muon_scale": ("moonlight", "keller"),
    "sample.sampler": ("euler", "heun"),
}


class ConfigError(ValueError):
    """A config that cannot run; the message names the key and what to change."""


def _use_configs_package(file: Path) -> None:
    """Make `import configs...` inside a config file resolve to the `configs` folder that holds it (experiment
    files start from `configs.base`), by registering that folder as the `configs` package: no sys.path edit."""
    folder = next((p for p in file.resolve().parents if p.name == "configs" and (p / "__init__.py").is_file()), None)
    if folder is None:
        return
    current = sys.modules.get("configs")
    if current is not None and [str(folder)] == list(getattr(current, "__path__", [])):
        return
    for name in [m for m in sys.modules if m == "configs" or m.startswith("configs.")]:
        del sys.modules[name]  # another configs/ tree was loaded before: its modules must not leak into this one
    spec = importlib.util.spec_from_file_location(
        "configs", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["configs"] = module
    spec.loader.exec_module(module)


def load_module(path: str):
    """Execute the config file `path` as a module (its `get_config`, and whatever else it defines)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {path!r} does not exist (try configs/tiny.py)")
    _use_configs_package(file)
    spec = importlib.util.spec_from_file_location(f"reve_config_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path!r} has no get_config() function")
    return module


def load_config(spec: str, overrides: list[str] = ()) -> ml_collections.ConfigDict:
    """Load `path[:arg]`, apply `a.b=value` overrides (the `--config.` prefix is optional), validate, and return
    a locked ConfigDict."""
    path, _, arg = spec.partition(":")
    module = load_module(path)
    takes_arg = len(inspect.signature(module.get_config).parameters) > 0
    try:
        cfg = module.get_config(arg or None) if takes_arg else module.get_config()
    except AttributeError as e:  # a locked base config rejects new keys
        raise ConfigError(f"{path}: {e}") from None
    cfg.lock()
    for item in overrides:
        apply_override(cfg, item)
    validate(cfg)
    return cfg


def _parse_value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare string such as --config.optim.name=muon


def apply_override(cfg: ml_collections.ConfigDict, item: str) -> None:
    """Apply one `--config.a.b=value` override in place; unknown keys and wrong types are ConfigErrors."""
    key, sep, raw = item.removeprefix("--").removeprefix("config.").partition("=")
    if not sep:
        raise ConfigError(f"override {item!r} must look like --config.model.depth=4")
    *parents, leaf = key.split(".")
    node = cfg
    for i, part in enumerate(parents):
        if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
            raise ConfigError(f"unknown config section {'.'.join(parents[: i + 1])!r} in override {item!r}")
        node = node[part]
    if leaf not in node:
        known = ", ".join(sorted(node.keys()))
        raise ConfigError(f"unknown config key {key!r}; keys at this level: {known}")
    old = node[leaf]
    value = _parse_value(raw)
    if isinstance(old, tuple) and isinstance(value, list):
        value = tuple(value)
    if isinstance(old, tuple) and not isinstance(value, tuple):
        value = (value,)
    if isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if old is not None and not isinstance(value, type(old)):
        raise ConfigError(f"config key {key!r} expects {type(old).__name__}, got {raw!r} ({type(value).__name__})")
    try:
        node[leaf] = value
    except (TypeError, AttributeError) as e:
        raise ConfigError(f"config key {key!r}: {e}") from None


def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def validate(cfg: ml_collections.ConfigDict) -> None:
    """Check every combination that would otherwise fail later (or silently): raise ConfigError naming the keys."""
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {allowed}")
    m, d = cfg.model, cfg.data
    if m.width % m.heads:
        raise ConfigError(f"model.heads={m.heads} does not divide model.width={m.width}")
    if (m.width // m.heads) % 4:
        raise ConfigError(f"head dim model.width/model.heads={m.width // m.heads} must be divisible by 4 (2D RoPE)")
    for key in ("worker_threads", "worker_processes", "prefetch"):
        if d[key] < 0:
            raise ConfigError(f"data.{key}={d[key]} must be >= 0")
    if d.image_size % m.patch:
        raise ConfigError(f"data.image_size={d.image_size} is not divisible by model.patch={m.patch}")
    if cfg.text.width % cfg.text.heads or (cfg.text.width // cfg.text.heads) % 4:
        raise ConfigError(f"text.heads={cfg.text.heads} must divide text.width={cfg.text.width} into multiples of 4")
    if not 0 < m.route.keep_ratio <= 1:
        raise ConfigError(f"model.route.keep_ratio={m.route.keep_ratio} must be in (0, 1]")
    if m.route.enabled:
        end = m.route.end if m.route.end >= 0 else m.depth + m.route.end
        if not 0 <= m.route.start < end <= m.depth:
            raise ConfigError(
                f"model.route.start={m.route.start}, model.route.end={m.route.end}: the routed blocks "
                f"[{m.route.start}, {end}) must lie inside the {m.depth} blocks"
            )
    if m.repa_block >= m.depth:
        raise ConfigError(f"model.repa_block={m.repa_block} >= model.depth={m.depth}")
    if m.arch == "ddt":
        if m.ddt.enc_patch % m.patch or d.image_size % m.ddt.enc_patch:
            raise ConfigError(
                f"model.ddt.enc_patch={m.ddt.enc_patch} must be a multiple of model.patch={m.patch} "
                f"and divide data.image_size={d.image_size}"
            )
        if m.ddt.enc_patch % m.ddt.enc_downsample:
            raise ConfigError(
                f"model.ddt.enc_downsample={m.ddt.enc_downsample} must divide model.ddt.enc_patch={m.ddt.enc_patch}"
            )
        if m.ddt.enc_width % m.ddt.enc_heads or (m.ddt.enc_width // m.ddt.enc_heads) % 4:
            raise ConfigError(f"model.ddt.enc_heads={m.ddt.enc_heads} must split model.ddt.enc_width evenly by 4")
    lt = cfg.latent
    if lt.path:
        f = lt.downsample
        if f < 1 or f & (f - 1):
            raise ConfigError(f"latent.downsample={f} must be a power of 2")
        if d.image_size % (f * m.patch):
            raise ConfigError(
                f"data.image_size={d.image_size} must be divisible by latent.downsample x model.patch = {f * m.patch}"
            )
        if m.arch != "dit":
            raise ConfigError("latent.path is set: latent diffusion runs model.arch='dit' (JIT-DDT works on pixels)")
        on = [k for k in ("lpips_weight", "dino_weight", "repa_weight") if cfg.loss[k] > 0]
        if on:
            raise ConfigError(f"latent.path is set: the pixel-space losses {on} do not apply; set them to 0")
    lo = cfg.loss
    weighted = [("lpips", lo.lpips_path, "")]
    if lo.dino_target == "dinov2":  # the 'features' target needs no weight file
        weighted.append(("dino", lo.dino_path, ", or loss.dino_target='features' (the project's feature network)"))
    for term, path, alternative in weighted:
        if lo[f"{term}_weight"] > 0 and not path:
            raise ConfigError(
                f"loss.{term}_weight={lo[f'{term}_weight']} needs loss.{term}_path: convert the weights with "
                f"scripts/convert_weights.py (see docs/perceptual.md){alternative}"
            )
    if lo.repa_weight > 0:
        if lo.repa_target == "dinov2" and not lo.dino_path:
            raise ConfigError(
                "loss.repa_weight > 0 with loss.repa_target='dinov2' needs loss.dino_path (converted DINOv2 weights, "
                "docs/perceptual.md), or loss.repa_target='features' for the project's own feature network"
            )
        if m.repa_block < 0:
            raise ConfigError("loss.repa_weight > 0 needs model.repa_block >= 0 (the block whose tokens are aligned)")
    tr = cfg.train
    if tr.global_batch <= 0 or tr.grad_accum <= 0 or tr.global_batch % tr.grad_accum:
        raise ConfigError(
            f"train.global_batch={tr.global_batch} must be a positive multiple of train.grad_accum={tr.grad_accum}"
        )
    for axis in ("data", "fsdp", "tensor"):
        size = cfg.mesh[axis]
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{axis}={size}: use a positive size or -1 (the devices left over)")
    if [cfg.mesh[a] for a in ("data", "fsdp", "tensor")].count(-1) > 1:
        raise ConfigError("only one of mesh.data, mesh.fsdp, mesh.tensor may be -1")
    lo, hi = cfg.sample.cfg_interval
    if not 0 <= lo <= hi <= 1:
        raise ConfigError(f"sample.cfg_interval={cfg.sample.cfg_interval} must satisfy 0 <= lo <= hi <= 1")
    if not (0 <= cfg.sample.t_eps < 1 or cfg.sample.t_eps == -1):
        raise ConfigError(
            f"sample.t_eps={cfg.sample.t_eps} must lie in [0, 1) (0: the sampler's exact velocity) or be -1 "
            f"(training's clamp, diffusion.t_eps)"
        )
    if not cfg.ema.decays or not all(0 < x < 1 for x in cfg.ema.decays):
        raise ConfigError(f"ema.decays={cfg.ema.decays} must be a non-empty tuple of values in (0, 1)")


def to_json(cfg: ml_collections.ConfigDict) -> str:
    return cfg.to_json(sort_keys=True)


# Keys added to configs/base.py after runs were saved, with the value under which those runs trained: a saved config
# that lacks one is read with it (`from_json`, and the resume check in trainer.py), so an old run samples, scores and
# resumes as it trained. Add an entry here with every new key whose default would change what an older run does.
ADDED_KEYS = {
    "model.pos_embed": "none",  # no absolute position embedding before it existed
    "data.render": "fixed",  # one image per caption, the rendering before the jittered one
    "data.min_objects": 1,
    "data.shapes": (),
    "data.colors": (),
    "data.heldout_frac": 0.0,  # runs before the split trained on every composition
    "data.heldout_seed": 0,
    "data.caption_drop": 0.0,  # every caption stated every attribute
    "data.shift": 0.0,  # objects centered in their cells
    "text.pooled": True,  # the pooled caption joined the time embedding
    "model.text_stream": "joint",  # the blocks updated the caption tokens
    "optim.decay_frac": 0.2,
    "data.stages": (),
    "ema.warmup_power": -1.0,  # a fixed EMA decay from the first step
    "text.frozen_encoder": "",
    "text.frozen_encoder_path": "",
    "latent.path": "",  # pixel space
    "latent.res_blocks": 0,  # the plain convolution stack
    "latent.train_render": "",  # the autoencoder trained on the run's own rendering
    "loss.repa_weight": 0.0,
    "loss.repa_target": "dinov2",
    "loss.dino_target": "dinov2",
    "loss.repa_dim": 768,
    "loss.repa_hidden": 1024,
    "sample.score_num": 0,
    "sample.t_eps": -1.0,  # runs before it sampled x-prediction with training's clamp, diffusion.t_eps
}


def from_json(text: str) -> ml_collections.ConfigDict:
    """Rebuild a config saved in a checkpoint (lists come back as tuples, as the base declares them; keys the
    config predates come back with the value it trained under, see ADDED_KEYS)."""

    def fix(node):
        if isinstance(node, dict):
            return {k: fix(v) for k, v in node.items()}
        if isinstance(node, list):
            return tuple(fix(v) for v in node)
        return node

    tree = fix(json.loads(text))
    for dotted, value in ADDED_KEYS.items():
        *parents, leaf = dotted.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node.setdefault(leaf, value)
    cfg = ml_collections.ConfigDict(tree)
    cfg.lock()
    return cfg

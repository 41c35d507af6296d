"""Converting the official PyTorch checkpoints of the perceptual networks, and loading the converted files.

A converted file is a flat, pickle-free `.npz`: one float32 array per NNX parameter, named by its path
(`vgg/convs/0/kernel`, `blocks/3/attn/qkv/kernel`, ...), plus `meta/*` entries giving the kind of network and
its architecture. Reading a PyTorch `.pth` needs torch (the converter is a one-off, run where torch is
installed); reading a converted file needs only numpy. Nothing here ever downloads anything.

Sources understood:
- LPIPS: a torchvision VGG16 state dict (`features.N.weight/bias`; `classifier.*` ignored) or the lpips
  package's full LPIPS state dict (`net.sliceK.N.*`), plus the linear heads the lpips package ships in
  `lpips/weights/v0.1/vgg.pth` (`lin0.model.1.weight` ... `lin4.model.1.weight`).
- DINOv2: the torch-hub layout (`blocks.N.attn.qkv.weight`, `ls1.gamma`, `pos_embed`, ...) or the
  transformers layout (`embeddings.patch_embeddings.projection.weight`, `encoder.layer.N...`, a
  `.safetensors` file or a `save_pretrained` directory whose config.json gives the head count).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from reve_jax.perceptual.dinov2 import DinoV2, DinoV2Config
from reve_jax.perceptual.vgg_lpips import LPIPS, STAGE_DEPTHS, torchvision_conv_indices

LPIPS_CMD = "python scripts/convert_weights.py lpips --vgg VGG16_STATE_DICT.pth --out lpips_vgg.npz"
DINOV2_CMD = "python scripts/convert_weights.py dinov2 --src CHECKPOINT --out dinov2.npz"
TORCH_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt", ".safetensors")


# ------------------------------------------------------------------------------------- reading sources


def read_checkpoint(path: str | Path) -> tuple[dict[str, np.ndarray], dict]:
    """Reads a PyTorch checkpoint as float32 numpy arrays.

    path: a `.pth/.pt/.bin` file (torch.load, weights only), a `.safetensors` file, or a directory made by
    transformers' `save_pretrained` (model.safetensors or pytorch_model.bin, plus config.json).
    Returns (state dict, transformers config dict or {} when there is none).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    config: dict = {}
    if path.is_dir():
        for name in ("model.safetensors", "pytorch_model.bin"):
            if (path / name).exists():
                break
        else:
            raise FileNotFoundError(f"{path} holds neither model.safetensors nor pytorch_model.bin")
        path = path / name
    if (path.parent / "config.json").exists() and path.suffix in (".safetensors", ".bin"):
        config = json.loads((path.parent / "config.json").read_text())
    if path.suffix == ".safetensors":
        from safetensors.numpy import load_file

        try:
            return {k: np.asarray(v, np.float32) for k, v in load_file(str(path)).items()}, config
        except (TypeError, ValueError):
            pass  # bf16 tensors have no numpy dtype: read them through torch below
        from safetensors.torch import load_file as load_torch

        return {k: v.float().numpy() for k, v in load_torch(str(path)).items()}, config
    try:
        import torch
    except ImportError as e:
        msg = f"reading {path} needs torch (pip install torch): convert where torch is installed"
        raise ImportError(msg) from e
    sd = torch.load(str(path), map_location="cpu", weights_only=True)
    # Some training checkpoints wrap the weights one level down.
    for wrapper in ("state_dict", "model", "teacher"):
        if isinstance(sd, dict) and wrapper in sd and isinstance(sd[wrapper], dict):
            sd = sd[wrapper]
    if not isinstance(sd, dict):
        raise ValueError(f"{path} does not hold a state dict (got {type(sd).__name__})")
    return {k: v.detach().float().cpu().numpy() for k, v in sd.items() if hasattr(v, "detach")}, config


def shipped_lpips_heads() -> Path:
    """Path of the VGG linear heads inside the installed lpips package (found without importing it, since
    its __init__ imports torchvision)."""
    spec = importlib.util.find_spec("lpips")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("lpips is not installed: `pip install --no-deps lpips`, or pass --lin")
    return Path(spec.origin).parent / "weights" / "v0.1" / "vgg.pth"


def _need(sd: dict, key: str, shape: tuple[int, ...] | None, what: str, cmd: str) -> np.ndarray:
    """sd[key] checked against an expected shape; a clear error naming the key otherwise."""
    if key not in sd:
        raise ValueError(f"missing key '{key}': this is not {what}. Convert with: {cmd}")
    v = sd[key]
    if shape is not None and tuple(v.shape) != tuple(shape):
        raise ValueError(
            f"shape mismatch for '{key}': expected {tuple(shape)}, got {tuple(v.shape)} ({what}). Convert with: {cmd}"
        )
    return v


# ----------------------------------------------------------------------------------------------- LPIPS


def lpips_params_from_torch(vgg_sd: dict[str, np.ndarray], lin_sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Maps a torchvision VGG16 state dict and the lpips heads to the flat NNX params of `LPIPS`.

    Channel widths are read from the conv shapes, so narrow VGGs with the same layout convert too.
    Returns {nnx path: float32 array} including `meta/*` entries.
    """
    what = "a torchvision vgg16 state dict (features.N.weight)"
    # The lpips package's own LPIPS state dict splits `features` into slices but keeps torchvision's indices.
    vgg_sd = {re.sub(r"^net\.slice\d+\.", "features.", k): v for k, v in vgg_sd.items()}
    out: dict[str, np.ndarray] = {}
    c_in, widths = 3, []
    conv_indices = torchvision_conv_indices()
    stage_of = [s for s, depth in enumerate(STAGE_DEPTHS) for _ in range(depth)]
    for i, idx in enumerate(conv_indices):
        key = f"features.{idx}.weight"
        w = _need(vgg_sd, key, None, what, LPIPS_CMD)
        if w.ndim != 4 or w.shape[1:] != (c_in, 3, 3):
            raise ValueError(
                f"shape mismatch for '{key}': expected (C, {c_in}, 3, 3), got {tuple(w.shape)} ({what}). "
                f"Convert with: {LPIPS_CMD}"
            )
        if len(widths) == stage_of[i] + 1 and widths[-1] != w.shape[0]:
            raise ValueError(
                f"shape mismatch for '{key}': stage width {widths[-1]} expected, got {w.shape[0]} ({what})"
            )
        if len(widths) == stage_of[i]:
            widths.append(int(w.shape[0]))
        b = _need(vgg_sd, f"features.{idx}.bias", (w.shape[0],), what, LPIPS_CMD)
        out[f"vgg/convs/{i}/kernel"] = w.transpose(2, 3, 1, 0)
        out[f"vgg/convs/{i}/bias"] = b
        c_in = int(w.shape[0])
    what = "the lpips package's linear heads (lpips/weights/v0.1/vgg.pth)"
    for s, c in enumerate(widths):
        # Releases with dropout in the head store the conv at model.1, those without at model.0.
        key = f"lin{s}.model.1.weight" if f"lin{s}.model.1.weight" in lin_sd else f"lin{s}.model.0.weight"
        if key not in lin_sd:
            key = f"lin{s}.model.1.weight"
        w = _need(lin_sd, key, (1, c, 1, 1), what + f" for VGG widths {tuple(widths)}", LPIPS_CMD)
        if (w < 0).any():
            raise ValueError(f"'{key}' has negative weights: LPIPS heads are non-negative ({what})")
        out[f"heads/{s}/kernel"] = w.reshape(c, 1)
    out["meta/kind"] = np.array("lpips")
    out["meta/channels"] = np.array(widths, np.int64)
    return {k: (v.astype(np.float32) if v.dtype.kind == "f" else v) for k, v in out.items()}


def convert_lpips(vgg_path: str | Path, lin_path: str | Path | None, out_path: str | Path) -> Path:
    """Converts a VGG16 state dict (+ the lpips heads; None takes the file of the installed lpips package)
    into one `.npz` at out_path. Returns out_path."""
    vgg_sd, _ = read_checkpoint(vgg_path)
    lin_sd, _ = read_checkpoint(lin_path if lin_path is not None else shipped_lpips_heads())
    return save_params(lpips_params_from_torch(vgg_sd, lin_sd), out_path)


# ---------------------------------------------------------------------------------------------- DINOv2

_HF_BLOCK = {
    "norm1.weight": "norm1.weight",
    "norm1.bias": "norm1.bias",
    "attention.output.dense.weight": "attn.proj.weight",
    "attention.output.dense.bias": "attn.proj.bias",
    "attention.o_proj.weight": "attn.proj.weight",
    "attention.o_proj.bias": "attn.proj.bias",
    "layer_scale1.lambda1": "ls1.gamma",
    "norm2.weight": "norm2.weight",
    "norm2.bias": "norm2.bias",
    "mlp.fc1.weight": "mlp.fc1.weight",
    "mlp.fc1.bias": "mlp.fc1.bias",
    "mlp.fc2.weight": "mlp.fc2.weight",
    "mlp.fc2.bias": "mlp.fc2.bias",
    "layer_scale2.lambda1": "ls2.gamma",
}
_HF_TOP = {
    "embeddings.cls_token": "cls_token",
    "embeddings.position_embeddings": "pos_embed",
    "embeddings.register_tokens": "register_tokens",
    "embeddings.mask_token": "mask_token",
    "embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
    "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
    "layernorm.weight": "norm.weight",
    "layernorm.bias": "norm.bias",
}


def _hub_from_hf(sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Renames a transformers Dinov2Model state dict to the torch-hub layout (q, k, v fused into qkv)."""
    hub: dict[str, np.ndarray] = {}
    qkv: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for k, v in sd.items():
        m = re.fullmatch(r"encoder\.layer\.(\d+)\.(.+)", k)
        if m is None:
            hub[_HF_TOP.get(k, k)] = v
            continue
        i, rest = int(m.group(1)), m.group(2)
        # Files use attention.attention.{query,key,value}; transformers >= 5 names them q/k/v_proj in memory.
        a = re.fullmatch(r"attention\.(?:attention\.)?(query|key|value|q_proj|k_proj|v_proj)\.(weight|bias)", rest)
        if a:
            name = {"q_proj": "query", "k_proj": "key", "v_proj": "value"}.get(a.group(1), a.group(1))
            qkv.setdefault((i, a.group(2)), {})[name] = v
        else:
            hub[f"blocks.{i}.{_HF_BLOCK.get(rest, rest)}"] = v
    for (i, kind), parts in qkv.items():
        for name in ("query", "key", "value"):
            if name not in parts:
                raise ValueError(f"missing key 'encoder.layer.{i}.attention.attention.{name}.{kind}'")
        hub[f"blocks.{i}.attn.qkv.{kind}"] = np.concatenate([parts["query"], parts["key"], parts["value"]], 0)
    return hub


def dinov2_params_from_torch(
    sd: dict[str, np.ndarray],
    hf_config: dict | None = None,
    *,
    num_heads: int | None = None,
    interpolate_antialias: bool | None = None,
    interpolate_offset: float | None = None,
) -> dict[str, np.ndarray]:
    """Maps a DINOv2 state dict (hub or transformers layout) to the flat NNX params of `DinoV2`.

    The architecture is read from the shapes; the head count from `num_heads`, else the transformers config,
    else width // 64 (true of every released DINOv2). Position-embedding resampling follows the source:
    antialias for register models; the hub's 0.1 offset for hub models without registers.
    Returns {nnx path: float32 array} including `meta/*` entries.
    """
    hf_config = hf_config or {}
    sd = {re.sub(r"^(dinov2|backbone|module)\.", "", k): v for k, v in sd.items()}
    if "embeddings.patch_embeddings.projection.weight" in sd:
        layout, sd = "transformers", _hub_from_hf(sd)
    elif "patch_embed.proj.weight" in sd:
        layout = "hub"
        # Hub checkpoints saved with block chunking name blocks `blocks.<chunk>.<index>.`.
        sd = {re.sub(r"^blocks\.\d+\.(\d+\.)", r"blocks.\1", k): v for k, v in sd.items()}
    else:
        raise ValueError(
            "missing key 'patch_embed.proj.weight' (hub layout) or "
            "'embeddings.patch_embeddings.projection.weight' (transformers layout): not a DINOv2 checkpoint "
            f"(first keys: {sorted(sd)[:5]}). "
            f"Convert with: {DINOV2_CMD}"
        )
    what = f"a DINOv2 backbone in {layout} layout"
    if any(".mlp.w12." in k or ".weights_in." in k for k in sd):
        raise ValueError("SwiGLU feed-forward blocks (ViT-g/14) are not supported; use ViT-S/14 or ViT-B/14")
    cls = _need(sd, "cls_token", None, what, DINOV2_CMD)
    d = int(cls.shape[-1])
    pw = _need(sd, "patch_embed.proj.weight", None, what, DINOV2_CMD)
    patch = int(pw.shape[-1])
    pos = _need(sd, "pos_embed", None, what, DINOV2_CMD)
    grid = math.isqrt(pos.shape[1] - 1)
    if pos.ndim != 3 or grid * grid != pos.shape[1] - 1:
        raise ValueError(f"shape mismatch for 'pos_embed': {pos.shape} is not (1, 1 + g*g, {d})")
    depth = 1 + max((int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))), default=-1)
    mlp = int(_need(sd, "blocks.0.mlp.fc1.weight", None, what, DINOV2_CMD).shape[0])
    regs = int(sd["register_tokens"].shape[1]) if "register_tokens" in sd else 0
    heads = num_heads or hf_config.get("num_attention_heads") or d // 64
    if heads < 1 or d % heads:
        raise ValueError(f"cannot split width {d} into {heads} heads: pass --num-heads")
    if interpolate_antialias is None:
        interpolate_antialias = regs > 0
    if interpolate_offset is None:
        # The hub samples positions with `scale_factor=(n + 0.1) / grid` unless the model has registers.
        interpolate_offset = 0.1 if layout == "hub" and not regs else 0.0
    cfg = DinoV2Config(
        width=d,
        depth=depth,
        num_heads=int(heads),
        mlp_dim=mlp,
        patch_size=patch,
        pos_grid=grid,
        num_register_tokens=regs,
        layer_norm_eps=float(hf_config.get("layer_norm_eps", 1e-6)),
        interpolate_antialias=bool(interpolate_antialias),
        interpolate_offset=float(interpolate_offset),
    )

    def get(key, shape):
        return _need(sd, key, shape, what, DINOV2_CMD)

    out = {
        "patch_embed/kernel": get("patch_embed.proj.weight", (d, 3, patch, patch)).transpose(2, 3, 1, 0),
        "patch_embed/bias": get("patch_embed.proj.bias", (d,)),
        "cls_token": get("cls_token", (1, 1, d)),
        "pos_embed": get("pos_embed", (1, 1 + grid * grid, d)),
        "norm/scale": get("norm.weight", (d,)),
        "norm/bias": get("norm.bias", (d,)),
    }
    if regs:
        out["register_tokens"] = get("register_tokens", (1, regs, d))
    for i in range(depth):
        b = f"blocks.{i}."
        for name in ("norm1", "norm2"):
            out[f"blocks/{i}/{name}/scale"] = get(b + name + ".weight", (d,))
            out[f"blocks/{i}/{name}/bias"] = get(b + name + ".bias", (d,))
        for src, dst, shape in (
            ("attn.qkv", "attn/qkv", (3 * d, d)),
            ("attn.proj", "attn/proj", (d, d)),
            ("mlp.fc1", "fc1", (mlp, d)),
            ("mlp.fc2", "fc2", (d, mlp)),
        ):
            out[f"blocks/{i}/{dst}/kernel"] = get(f"{b}{src}.weight", shape).T
            out[f"blocks/{i}/{dst}/bias"] = get(f"{b}{src}.bias", shape[:1])
        out[f"blocks/{i}/ls1"] = get(b + "ls1.gamma", (d,))
        out[f"blocks/{i}/ls2"] = get(b + "ls2.gamma", (d,))
    out["meta/kind"] = np.array("dinov2")
    for field in ("width", "depth", "num_heads", "mlp_dim", "patch_size", "pos_grid", "num_register_tokens"):
        out[f"meta/{field}"] = np.array(getattr(cfg, field), np.int64)
    out["meta/layer_norm_eps"] = np.array(cfg.layer_norm_eps, np.float64)
    out["meta/interpolate_antialias"] = np.array(cfg.interpolate_antialias)
    out["meta/interpolate_offset"] = np.array(cfg.interpolate_offset, np.float64)
    return {k: (np.ascontiguousarray(v, np.float32) if v.dtype == np.float32 else v) for k, v in out.items()}


def convert_dinov2(src: str | Path, out_path: str | Path, **kwargs) -> Path:
    """Converts a DINOv2 checkpoint (hub `.pth`, `.safetensors`, or a transformers directory) into one
    `.npz` at out_path. kwargs go to `dinov2_params_from_torch`. Returns out_path."""
    sd, config = read_checkpoint(src)
    return save_params(dinov2_params_from_torch(sd, config, **kwargs), out_path)


# ------------------------------------------------------------------------------------- converted files


def save_params(params: dict[str, np.ndarray], out_path: str | Path) -> Path:
    """Writes flat params to an uncompressed `.npz` (written beside, then renamed, so a crash leaves no
    half-written file under the final name). Returns the path."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp.npz")
    np.savez(tmp, **params)
    tmp.replace(out_path)
    return out_path


def _read_converted(path: str | Path, kind: str, cmd: str) -> tuple[dict[str, np.ndarray], dict]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{kind} weights {path} not found. Convert the official weights with: {cmd}")
    if path.is_dir() or path.suffix in TORCH_SUFFIXES:
        raise ValueError(f"{path} is a PyTorch checkpoint, not a converted file. Convert with: {cmd}")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} is not a converted .npz ({e}). Convert with: {cmd}") from e
    found = str(arrays["meta/kind"]) if "meta/kind" in arrays else None
    if found != kind:
        raise ValueError(
            f"wrong layout: key 'meta/kind' of {path} is {found!r}, expected {kind!r}. Convert with: {cmd}"
        )
    meta = {k[len("meta/") :]: v for k, v in arrays.items() if k.startswith("meta/")}
    return {k: v for k, v in arrays.items() if not k.startswith("meta/")}, meta


def _fill(factory: Callable[[], nnx.Module], params: dict[str, np.ndarray], path, cmd: str) -> nnx.Module:
    """Builds the module abstractly (no random init) and fills it from flat params, checking every key."""
    graphdef, state = nnx.split(nnx.eval_shape(factory))

    def walk(tree, prefix):
        out = {}
        for k, v in tree.items():
            name = f"{prefix}{k}"
            if isinstance(v, dict):
                out[k] = walk(v, name + "/")
                continue
            if name not in params:
                raise ValueError(f"missing key '{name}' in {path}. Convert with: {cmd}")
            if tuple(params[name].shape) != tuple(v.shape):
                raise ValueError(
                    f"shape mismatch for '{name}' in {path}: the module expects {tuple(v.shape)}, "
                    f"the file has {tuple(params[name].shape)}. Convert with: {cmd}"
                )
            out[k] = jnp.asarray(params.pop(name), jnp.float32)
        return out

    params = dict(params)
    filled = walk(nnx.to_pure_dict(state), "")
    if params:
        raise ValueError(f"unexpected key '{sorted(params)[0]}' in {path}. Convert with: {cmd}")
    nnx.replace_by_pure_dict(state, filled)
    return nnx.merge(graphdef, state)


def load_lpips(path: str | Path, *, dtype: jnp.dtype = jnp.float32) -> LPIPS:
    """Loads a converted LPIPS file. dtype: compute dtype of the VGG convolutions (params stay float32).
    Returns a ready `LPIPS` module (use it frozen: see losses.py)."""
    params, meta = _read_converted(path, "lpips", LPIPS_CMD)
    channels = tuple(int(c) for c in meta["channels"])
    return _fill(lambda: LPIPS(channels, dtype=dtype, rngs=nnx.Rngs(0)), params, path, LPIPS_CMD)


def load_dinov2(path: str | Path, *, dtype: jnp.dtype = jnp.float32) -> DinoV2:
    """Loads a converted DINOv2 file; the architecture comes from the file. dtype: compute dtype of the
    matrix multiplies (params stay float32). Returns a ready `DinoV2` module."""
    params, meta = _read_converted(path, "dinov2", DINOV2_CMD)
    try:
        cfg = DinoV2Config(
            **{f: int(meta[f]) for f in ("width", "depth", "num_heads", "mlp_dim", "patch_size", "pos_grid")},
            num_register_tokens=int(meta["num_register_tokens"]),
            layer_norm_eps=float(meta["layer_norm_eps"]),
            interpolate_antialias=bool(meta["interpolate_antialias"]),
            interpolate_offset=float(meta["interpolate_offset"]),
        )
    except KeyError as e:
        raise ValueError(f"missing key 'meta/{e.args[0]}' in {path}. Convert with: {DINOV2_CMD}") from e
    return _fill(lambda: DinoV2(cfg, dtype=dtype, rngs=nnx.Rngs(0)), params, path, DINOV2_CMD)


def _flat(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = np.asarray(v, np.float32)
    return out


def export_lpips(module: LPIPS, channels: tuple[int, ...], out_path: str | Path) -> Path:
    """Writes an LPIPS module (e.g. a small random one for tests) in the converted format `load_lpips` reads."""
    params = _flat(nnx.to_pure_dict(nnx.state(module)))
    params["meta/kind"] = np.array("lpips")
    params["meta/channels"] = np.array(channels, np.int64)
    return save_params(params, out_path)


def export_dinov2(module: DinoV2, cfg: DinoV2Config, out_path: str | Path) -> Path:
    """Writes a DinoV2 module in the converted format `load_dinov2` reads."""
    params = _flat(nnx.to_pure_dict(nnx.state(module)))
    params["meta/kind"] = np.array("dinov2")
    for field in ("width", "depth", "num_heads", "mlp_dim", "patch_size", "pos_grid", "num_register_tokens"):
        params[f"meta/{field}"] = np.array(getattr(cfg, field), np.int64)
    params["meta/layer_norm_eps"] = np.array(cfg.layer_norm_eps, np.float64)
    params["meta/interpolate_antialias"] = np.array(cfg.interpolate_antialias)
    params["meta/interpolate_offset"] = np.array(cfg.interpolate_offset, np.float64)
    return save_params(params, out_path)

"""The recipe's techniques as functions on a config, so the baseline, the full recipe and each ablation
(baseline + one technique) are built from the same pieces. Sizes are the experiment files in configs/."""

import importlib

from reve_jax.config import apply_override

SIZES = ("tiny", "jit_b16", "prx_1b")
TECHNIQUES = ("jit", "bottleneck", "tread", "muon", "ddt", "repa", "latent", "smallpatch")
RECIPE = ("jit", "bottleneck", "tread", "muon")


def sized(size: str):
    """The base experiment config for a size name."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {SIZES}")
    return importlib.import_module(f"configs.{size}").get_config()


def baseline(c):
    """A DiT as in Peebles & Xie: plain linear patch embedding, v-prediction, logit-normal(0, 1) times, AdamW,
    every token through every block."""
    c.name = f"{c.name}_baseline"
    c.model.arch = "dit"
    c.model.bottleneck = 0
    c.model.route.enabled = False
    c.diffusion.prediction = "v"
    c.diffusion.loss_space = "v"
    c.diffusion.t_mean = 0.0
    c.diffusion.t_std = 1.0
    c.optim.name = "adamw"
    return c


def apply(c, technique: str, bottleneck_rank: int):
    """Switch one technique on."""
    if technique == "jit":  # x-prediction, loss in v-space, times biased to noise (JiT)
        c.diffusion.prediction = "x"
        c.diffusion.loss_space = "v"
        c.diffusion.t_mean = -0.8 if c.data.image_size >= 256 else -0.4
        c.diffusion.t_std = 0.8
    elif technique == "bottleneck":
        c.model.bottleneck = bottleneck_rank
    elif technique == "tread":  # blocks 1 .. depth-1 routed at keep 0.5 ("2nd to penultimate")
        c.model.route.enabled = True
        c.model.route.keep_ratio = 0.5
        c.model.route.start = 1
        c.model.route.end = -1
    elif technique == "muon":
        c.optim.name = "muon"
        c.optim.muon_scale = "moonlight"
    elif technique == "ddt":
        c.model.arch = "ddt"
        c.model.ddt.enc_patch = 2 * c.model.patch
        c.model.ddt.enc_downsample = c.model.ddt.enc_patch // 2 if c.data.image_size <= 64 else 8
        c.model.ddt.enc_width = c.model.width
        c.model.ddt.enc_heads = c.model.heads
        c.model.ddt.enc_depth = max(1, c.model.depth // 4)
        c.diffusion.t_eps = 0.1
    elif technique == "repa":
        # Linum's PixelREPA weight; the middle block's tokens (PRX: the 8th of 16). Without DINOv2 weights
        # (loss.dino_path) the target is the project's own feature network of the procedural dataset.
        c.loss.repa_weight = 0.1
        c.model.repa_block = c.model.depth // 2
        c.loss.repa_hidden = 2 * c.model.width
        if not c.loss.dino_path:
            c.loss.repa_target = "features"
            c.loss.repa_dim = 48  # perceptual/shapes.py's cell embedding width
    elif technique == "latent":
        # Linum's baseline: a DiT on the latents of an autoencoder, at the pixel model's token count (a size file may
        # give it its own: configs/speedup/cpu.py). The size's model overrides choose the autoencoder
        # (latent.downsample, latent.channels; else the base's f=4 with 16 channels). latent.path must name the
        # trained autoencoder: a default location fails with a clear error until scripts/train_autoencoder.py
        # writes it there.
        side = c.data.image_size // c.model.patch  # tokens per side of the pixel model
        c.model.patch = max(1, c.data.image_size // c.latent.downsample // side)
        c.latent.path = c.latent.path or f"weights/autoencoder_{c.data.image_size}px.npz"
    elif technique == "smallpatch":  # JiT's working pixel baseline: 4 px patches, 48 values per token
        c.model.patch = 4
    else:
        raise ValueError(f"unknown technique {technique!r}; choose from {TECHNIQUES}")
    c.name = f"{c.name}+{technique}"
    return c


def build(arg: str | None, default_techniques: tuple[str, ...]):
    """Parse `size[,technique...]` and return the baseline of that size with the techniques on."""
    parts = [p for p in (arg or "tiny").split(",") if p]
    size, techniques = parts[0], tuple(parts[1:]) or default_techniques
    base = sized(size)
    rank = base.model.bottleneck or 32
    c = baseline(base)
    for t in techniques:
        c = apply(c, t, rank)
    return c


# The speedup benchmark's methods as techniques on the pixel v-prediction DiT (`baseline`). The JIT-DDT recipe is
# JiT's x-prediction with the bottleneck embedding, DDT's encoder-decoder towers and REPA (to DINOv2 when its
# weights are given, else to the project's feature network; LPIPS and DINOv2 losses join through overrides when
# their weight files are given); the PRX variant adds TREAD and Muon.
JIT_DDT = ("jit", "bottleneck", "ddt", "repa")
METHODS = {
    "latent": ("latent",),  # baseline A: Linum's comparison, a latent DiT over an autoencoder
    "pixel": ("smallpatch",),  # baseline B: JiT's comparison, pixel v-prediction at 48 values per token
    "pixel_p8": (),  # control: pixel v-prediction at the size's patch (JiT's failure regime)
    "recipe": JIT_DDT,
    "prx": (*JIT_DDT, "tread", "muon"),
    "recipe+muon": (*JIT_DDT, "muon"),  # the 2x2's fourth arm: the recipe with Muon for its 2D weights
    "baseline": (),  # the plain DiT (configs/recipe/baseline.py)
}


ABLATED = ("recipe", "prx")  # methods with leave-one-out ablations: <method>-<technique>


def ablated(method: str) -> str | None:
    """The method a leave-one-out ablation `<method>-<t>` starts from ('recipe-ddt' -> 'recipe'), else None."""
    base = method.split("-", 1)[0]
    return base if base in ABLATED and method != base else None


def techniques_of(method: str) -> tuple[str, ...]:
    """A method's techniques: a METHODS name; `recipe-<t>` or `prx-<t>` (the recipe or the PRX variant without
    technique t: a leave-one-out ablation); or techniques joined by + on the plain DiT ('tread+muon')."""
    if method in METHODS:
        return METHODS[method]
    base = ablated(method)
    if base:
        left_out = method.removeprefix(f"{base}-")
        if left_out not in METHODS[base]:
            raise ValueError(f"{method}: {base} has no technique {left_out!r} to leave out ({METHODS[base]})")
        return tuple(t for t in METHODS[base] if t != left_out)
    techniques = tuple(method.split("+"))
    unknown = [t for t in techniques if t not in TECHNIQUES]
    if unknown:
        raise ValueError(f"unknown method {method!r}: methods {sorted(METHODS)}, recipe-<t>, or + of {TECHNIQUES}")
    return techniques


def method_config(size: str, model: tuple[str, ...], train: tuple[str, ...], method: str, frozen: dict | None = None):
    """A benchmark run's config: the `size` experiment config with the `model` overrides (model and data size), made
    the baseline, the method's techniques switched on, then the `train` overrides (budget, batch, schedule), then
    the method's entry of `frozen` ({"lr", "cfg_scale"}: what the size's sweep chose; "muon_lr": Muon's own rate,
    else Muon takes "lr"). A leave-one-out ablation (`recipe-<t>`, `prx-<t>`) without an entry of its own takes its
    method's: it changes one technique and nothing else. The optimizer's rates never come from the `size`
    experiment config: its tuning (tiny's Muon rate) is for its own job, and a method must not inherit a rate its
    sweep did not choose."""
    c = sized(size)
    for item in model:
        apply_override(c, item)
    rank = c.model.bottleneck or 32
    c = baseline(c)
    for t in techniques_of(method):
        c = apply(c, t, rank)
    for item in train:
        apply_override(c, item)
    frozen = frozen or {}
    chosen = frozen.get(method) or frozen.get(ablated(method), {})
    c.optim.muon_lr = float(chosen.get("muon_lr", 0.0))
    if "lr" in chosen:
        c.optim.lr = float(chosen["lr"])
    if "cfg_scale" in chosen:
        c.sample.cfg_scale = float(chosen["cfg_scale"])
    c.name = method
    return c

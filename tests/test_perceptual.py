"""Parity of the NNX VGG16-LPIPS and DINOv2 against PyTorch references with random weights, converted through
reve_jax.perceptual.weights; clear errors for bad files; gradients reach only the image."""

import importlib.util
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # a test requirement (requirements-dev.txt)
from flax import nnx
from util import load_script

from reve_jax.perceptual import (
    convert_dinov2,
    convert_lpips,
    cubic_resize_matrix,
    dino_loss,
    load_dinov2,
    load_lpips,
    lpips_loss,
    resize,
)
from reve_jax.perceptual.weights import save_params

F = torch.nn.functional

TINY_VGG = (4, 8, 8, 16, 16)
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def nchw(x) -> "torch.Tensor":
    return torch.from_numpy(np.ascontiguousarray(np.asarray(x, np.float32).transpose(0, 3, 1, 2)))


def run(fn, module, *args):
    """fn(module, *args) compiled once: eager dispatch of every op costs more than one compile on CPU."""
    graphdef, state = nnx.split(module)
    return jax.jit(lambda st, *a: fn(nnx.merge(graphdef, st), *a))(state, *args)


def images(seed, b, h, w):
    return np.random.default_rng(seed).uniform(-1, 1, (b, h, w, 3)).astype(np.float32)


# ------------------------------------------------------------------------------------ torch references: LPIPS


class TorchVGG(torch.nn.Module):
    """torchvision's vgg16 layer layout (so state-dict keys are features.N.*), any channel widths."""

    def __init__(self, channels):
        super().__init__()
        layers, c_in = [], 3
        for c, depth in zip(channels, (2, 2, 3, 3, 3), strict=True):
            for _ in range(depth):
                layers += [torch.nn.Conv2d(c_in, c, 3, padding=1), torch.nn.ReLU()]
                c_in = c
            layers.append(torch.nn.MaxPool2d(2, 2))
        self.features = torch.nn.Sequential(*layers)


def torch_taps(vgg, x):
    """LPIPS v0.1: scaling layer, then the taps relu1_2 ... relu5_3 (indices 3, 8, 15, 22, 29)."""
    shift = torch.tensor([-0.030, -0.088, -0.188]).view(1, 3, 1, 1)
    scale = torch.tensor([0.458, 0.448, 0.450]).view(1, 3, 1, 1)
    x, out = (x - shift) / scale, []
    for i, layer in enumerate(vgg.features[:30]):
        x = layer(x)
        if i in (3, 8, 15, 22, 29):
            out.append(x)
    return out


def torch_lpips(vgg, heads, x0, x1):
    """The lpips package's LPIPS.forward (spatial=False) with the same math, written here in torch."""
    total = 0.0
    for w, a, b in zip(heads, torch_taps(vgg, x0), torch_taps(vgg, x1), strict=True):
        na = a / (torch.sqrt(torch.sum(a**2, dim=1, keepdim=True)) + 1e-10)
        nb = b / (torch.sqrt(torch.sum(b**2, dim=1, keepdim=True)) + 1e-10)
        total = total + F.conv2d((na - nb) ** 2, w).mean([2, 3], keepdim=True)
    return total[:, 0, 0, 0]


@pytest.fixture(scope="module")
def tiny_lpips(tmp_path_factory):
    """(torch vgg, torch heads, converted LPIPS module, path): narrow VGG, random non-negative heads."""
    torch.manual_seed(0)
    vgg = TorchVGG(TINY_VGG).eval()
    heads = [torch.rand(1, c, 1, 1) for c in TINY_VGG]
    d = tmp_path_factory.mktemp("lpips")
    torch.save(vgg.state_dict(), d / "vgg.pth")
    torch.save({f"lin{i}.model.1.weight": w for i, w in enumerate(heads)}, d / "lin.pth")
    path = convert_lpips(d / "vgg.pth", d / "lin.pth", d / "lpips.npz")
    return vgg, heads, load_lpips(path), path


def test_lpips_features_and_distance_match_torch(tiny_lpips):
    vgg, heads, net, _ = tiny_lpips
    x0, x1 = images(1, 2, 48, 48), images(2, 2, 48, 48)
    with torch.no_grad():
        ref_taps = torch_taps(vgg, nchw(x0))
        ref = torch_lpips(vgg, heads, nchw(x0), nchw(x1)).numpy()
    taps, dist, loss, small0, small1 = run(
        lambda n, a, b: (
            n.features(a),
            n(a, b),
            lpips_loss(n, a, b, downscale=0.5),
            resize(a, 24, 24),
            resize(b, 24, 24),
        ),
        net,
        jnp.asarray(x0),
        jnp.asarray(x1),
    )
    for ours, theirs in zip(taps, ref_taps, strict=True):
        assert rel_err(ours, theirs.numpy().transpose(0, 2, 3, 1)) < 1e-4
    assert rel_err(dist, ref) < 1e-4
    # The loss resizes both images first (antialiased bilinear, x0.5) and returns one value per sample.
    with torch.no_grad():
        ref_small = torch_lpips(vgg, heads, nchw(small0), nchw(small1)).numpy()
    assert loss.shape == (2,) and rel_err(loss, ref_small) < 1e-4


def test_lpips_real_head_file_full_width(tmp_path):
    """The lpips package's shipped head file, converted beside a full-width VGG16 with random weights."""
    spec = importlib.util.find_spec("lpips")
    assert spec is not None, "lpips is a test requirement: pip install --no-deps -r requirements-nodeps.txt"
    lin_file = Path(spec.origin).parent / "weights" / "v0.1" / "vgg.pth"
    torch.manual_seed(1)
    vgg = TorchVGG((64, 128, 256, 512, 512)).eval()
    state = vgg.state_dict()
    # A full torchvision state dict also holds the classifier; the converter ignores it.
    state["classifier.0.weight"] = torch.zeros(4, 4)
    torch.save(state, tmp_path / "vgg16.pth")
    path = convert_lpips(tmp_path / "vgg16.pth", lin_file, tmp_path / "lpips.npz")
    shipped = torch.load(lin_file, map_location="cpu", weights_only=True)
    heads = [shipped[f"lin{i}.model.1.weight"] for i in range(5)]
    x0, x1 = images(3, 1, 32, 32), images(4, 1, 32, 32)
    with torch.no_grad():
        ref = torch_lpips(vgg, heads, nchw(x0), nchw(x1)).numpy()
    assert rel_err(run(lambda n, a, b: n(a, b), load_lpips(path), jnp.asarray(x0), jnp.asarray(x1)), ref) < 1e-4


def test_lpips_gradient_reaches_image_only(tiny_lpips):
    _, _, net, _ = tiny_lpips
    x_hat, x = jnp.asarray(images(5, 2, 32, 32)), jnp.asarray(images(6, 2, 32, 32))
    # The parameters are an argument here, as in a jitted train step, and still receive no gradient.
    graphdef, state = nnx.split(net)
    loss = lambda st, xh: lpips_loss(nnx.merge(graphdef, st), xh, x).sum()
    g_params, g = jax.jit(jax.grad(loss, argnums=(0, 1)))(state, x_hat)
    assert np.all(np.isfinite(g)) and np.abs(g).max() > 0
    assert all(np.all(np.asarray(leaf) == 0) for leaf in jax.tree.leaves(g_params))


def test_lpips_bf16_close_to_f32(tiny_lpips):
    _, _, net, path = tiny_lpips
    x0, x1 = jnp.asarray(images(7, 2, 32, 32)), jnp.asarray(images(8, 2, 32, 32))
    low = load_lpips(path, dtype=jnp.bfloat16)
    assert low.vgg.convs[0].kernel[...].dtype == jnp.float32
    d_low, d_f32 = run(lambda pair, a, b: (pair[0](a, b), pair[1](a, b)), nnx.List([low, net]), x0, x1)
    assert rel_err(d_low, d_f32) < 5e-2


# ----------------------------------------------------------------------------------- torch references: DINOv2


def hf_model(registers: int):
    """A tiny transformers DINOv2 (4x4 position grid at 56 px) with all weights randomised."""
    import transformers

    kw = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        mlp_ratio=4,
        image_size=56,
        patch_size=14,
        attn_implementation="eager",
    )
    if registers:
        model = transformers.Dinov2WithRegistersModel(
            transformers.Dinov2WithRegistersConfig(num_register_tokens=registers, **kw)
        )
    else:
        model = transformers.Dinov2Model(transformers.Dinov2Config(**kw))
    torch.manual_seed(registers)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def hf_tokens(model, x, registers):
    """(cls [B, D], patch tokens [B, N, D]) after the final layernorm, from NHWC images in [-1, 1]."""
    pixels = nchw(((x + 1) / 2 - IMAGENET_MEAN) / IMAGENET_STD)
    with torch.no_grad():
        h = model(pixel_values=pixels).last_hidden_state.numpy()
    return h[:, 0], h[:, 1 + registers :]


def hub_state_dict(model, tmp_path) -> dict:
    """The torch-hub layout of a transformers DINOv2 checkpoint file: renamed keys, q/k/v fused into qkv."""
    from safetensors.torch import load_file

    model.save_pretrained(tmp_path / "for_hub")
    top = {
        "embeddings.cls_token": "cls_token",
        "embeddings.mask_token": "mask_token",
        "embeddings.position_embeddings": "pos_embed",
        "embeddings.register_tokens": "register_tokens",
        "embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
        "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
        "layernorm.weight": "norm.weight",
        "layernorm.bias": "norm.bias",
    }
    block = {
        "attention.output.dense": "attn.proj",
        "layer_scale1.lambda1": "ls1.gamma",
        "layer_scale2.lambda1": "ls2.gamma",
    }
    sd, out = load_file(tmp_path / "for_hub" / "model.safetensors"), {}
    for k, v in sd.items():
        m = re.fullmatch(r"encoder\.layer\.(\d+)\.(.+)", k)
        if m is None:
            out[top[k]] = v.clone()
            continue
        rest = m.group(2)
        if rest.startswith("attention.attention."):
            continue
        for a, b in block.items():
            rest = rest.replace(a, b)
        out[f"blocks.{m.group(1)}.{rest}"] = v.clone()
    for i in range(model.config.num_hidden_layers):
        for kind in ("weight", "bias"):
            parts = [sd[f"encoder.layer.{i}.attention.attention.{n}.{kind}"] for n in ("query", "key", "value")]
            out[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat(parts, 0)
    return out


@pytest.mark.parametrize(
    "registers, other_size",
    [(0, (70, 84)), (2, (42, 70))],  # upsampled grid; downsampled rows (antialiased) and upsampled columns
)
def test_dinov2_transformers_parity(tmp_path, registers, other_size):
    model = hf_model(registers)
    model.save_pretrained(tmp_path / "hf")
    net = load_dinov2(convert_dinov2(tmp_path / "hf", tmp_path / "dino.npz"))
    assert net.cfg.num_heads == 2 and net.cfg.num_register_tokens == registers
    for h, w in [(56, 56), other_size]:
        x = images(h + w, 2, h, w)
        cls, patch = hf_tokens(model, x, registers)
        ours = run(lambda n, a: n(a), net, jnp.asarray(x))
        assert ours.patch.shape == patch.shape
        assert rel_err(ours.patch, patch) < 1e-4, (h, w)
        assert rel_err(ours.cls, cls) < 1e-4, (h, w)


def test_dinov2_hub_layout(tmp_path):
    model = hf_model(2)
    torch.save(hub_state_dict(model, tmp_path), tmp_path / "hub.pth")
    net = load_dinov2(convert_dinov2(tmp_path / "hub.pth", tmp_path / "dino.npz", num_heads=2))
    x = images(9, 2, 42, 70)
    cls, patch = hf_tokens(model, x, 2)
    ours = run(lambda n, a: n(a), net, jnp.asarray(x))
    assert rel_err(ours.patch, patch) < 1e-4 and rel_err(ours.cls, cls) < 1e-4
    # Without registers the hub resamples position embeddings with a 0.1 offset; at the trained size it is
    # the same network as transformers'.
    plain = hf_model(0)
    torch.save(hub_state_dict(plain, tmp_path), tmp_path / "hub0.pth")
    net0 = load_dinov2(convert_dinov2(tmp_path / "hub0.pth", tmp_path / "dino0.npz", num_heads=2))
    assert net0.cfg.interpolate_offset == pytest.approx(0.1) and not net0.cfg.interpolate_antialias
    x = images(10, 1, 56, 56)
    assert rel_err(run(lambda n, a: n(a).patch, net0, jnp.asarray(x)), hf_tokens(plain, x, 0)[1]) < 1e-4


def test_dinov2_in_memory_transformers_names(tmp_path):
    """transformers >= 5 names attention q/k/v/o_proj in memory: a torch.save'd state dict converts too."""
    model = hf_model(0)
    model.save_pretrained(tmp_path / "hf")
    torch.save(model.state_dict(), tmp_path / "sd.pth")
    with (
        np.load(convert_dinov2(tmp_path / "hf", tmp_path / "a.npz")) as a,
        np.load(convert_dinov2(tmp_path / "sd.pth", tmp_path / "b.npz", num_heads=2)) as b,
    ):
        assert sorted(a.files) == sorted(b.files)
        for k in a.files:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize(
    "n_in, n_out, antialias, offset",
    [(4, 7, False, 0.0), (7, 3, False, 0.0), (37, 16, True, 0.0), (5, 9, True, 0.0), (37, 16, False, 0.1)],
)
def test_cubic_resize_matrix_matches_torch(n_in, n_out, antialias, offset):
    # 2-D in torch (its antialiased kernel mishandles a width-1 axis); the width is left unchanged.
    v = np.random.default_rng(n_in).normal(size=(1, 1, n_in, 3)).astype(np.float32)
    kw = dict(size=(n_out, 3)) if offset == 0 else dict(scale_factor=((n_out + offset) / n_in, 1.0))
    ref = F.interpolate(torch.from_numpy(v), mode="bicubic", align_corners=False, antialias=antialias, **kw)
    ours = cubic_resize_matrix(n_in, n_out, antialias=antialias, offset=offset) @ v[0, 0]
    assert ref.shape[2] == n_out and rel_err(ours, ref.numpy()[0, 0]) < 1e-5


def test_dino_loss_per_sample_and_gradient(tmp_path):
    model = hf_model(2)
    model.save_pretrained(tmp_path / "hf")
    net = load_dinov2(convert_dinov2(tmp_path / "hf", tmp_path / "dino.npz"))
    x_hat, x = jnp.asarray(images(11, 2, 64, 64)), jnp.asarray(images(12, 2, 64, 64))
    low = load_dinov2(tmp_path / "dino.npz", dtype=jnp.bfloat16)

    def check(pair, xh, x):
        n, lo = pair
        t_hat, t = n(resize(xh, 42, 42)).patch, n(resize(x, 42, 42)).patch
        g = jax.grad(lambda a: dino_loss(n, a, x, size=42).sum())(xh)
        return dino_loss(n, xh, x, size=42), t_hat, t, dino_loss(n, x, x, size=42), g, lo(x).patch, n(x).patch

    loss, t_hat, t, same, g, p_low, p_f32 = run(check, nnx.List([net, low]), x_hat, x)
    cos = np.sum(t_hat * t, -1) / (np.linalg.norm(t_hat, axis=-1) * np.linalg.norm(t, axis=-1))
    assert loss.shape == (2,) and rel_err(loss, np.mean(1 - cos, -1)) < 1e-4
    assert np.allclose(same, 0.0, atol=1e-5)
    assert np.all(np.isfinite(g)) and np.abs(g).max() > 0
    assert rel_err(p_low, p_f32) < 5e-2


# ----------------------------------------------------------------------------------------------- clear errors


def test_missing_file_names_the_convert_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="convert_weights.py lpips"):
        load_lpips(tmp_path / "nope.npz")
    with pytest.raises(FileNotFoundError, match="convert_weights.py dinov2"):
        load_dinov2(tmp_path / "nope.npz")


def test_wrong_layout_errors(tmp_path, tiny_lpips):
    _, _, _, lpips_path = tiny_lpips
    with pytest.raises(ValueError, match="'meta/kind'.*convert_weights.py dinov2"):
        load_dinov2(lpips_path)
    torch.save({"features.0.weight": torch.zeros(4, 3, 3, 3)}, tmp_path / "vgg.pth")
    with pytest.raises(ValueError, match="not a converted file.*convert_weights.py lpips"):
        load_lpips(tmp_path / "vgg.pth")
    with pytest.raises(ValueError, match="'features.0.bias'"):
        convert_lpips(tmp_path / "vgg.pth", tmp_path / "vgg.pth", tmp_path / "out.npz")
    torch.save({"some.other.weight": torch.zeros(2)}, tmp_path / "other.pth")
    with pytest.raises(ValueError, match="'patch_embed.proj.weight'"):
        convert_dinov2(tmp_path / "other.pth", tmp_path / "out.npz")


def test_shape_mismatch_errors(tmp_path, tiny_lpips):
    vgg, heads, _, lpips_path = tiny_lpips
    torch.save(vgg.state_dict(), tmp_path / "vgg.pth")
    # Heads of the wrong width for this VGG: the message names the head's key.
    torch.save(
        {f"lin{i}.model.1.weight": torch.rand(1, 2 * c, 1, 1) for i, c in enumerate(TINY_VGG)},
        tmp_path / "lin.pth",
    )
    with pytest.raises(ValueError, match="shape mismatch for 'lin0.model.1.weight'"):
        convert_lpips(tmp_path / "vgg.pth", tmp_path / "lin.pth", tmp_path / "out.npz")
    # A converted file edited to a wrong shape: the message names the NNX parameter path.
    with np.load(lpips_path) as f:
        params = {k: f[k] for k in f.files}
    params["vgg/convs/2/kernel"] = np.zeros((3, 3, 8, 9), np.float32)
    save_params(params, tmp_path / "bad.npz")
    with pytest.raises(ValueError, match="shape mismatch for 'vgg/convs/2/kernel'"):
        load_lpips(tmp_path / "bad.npz")
    del params["vgg/convs/2/kernel"]
    save_params(params, tmp_path / "bad.npz")
    with pytest.raises(ValueError, match="missing key 'vgg/convs/2/kernel'"):
        load_lpips(tmp_path / "bad.npz")


def test_cli_converts(tmp_path, tiny_lpips):
    vgg, heads, net, _ = tiny_lpips
    torch.save(vgg.state_dict(), tmp_path / "vgg.pth")
    torch.save({f"lin{i}.model.1.weight": w for i, w in enumerate(heads)}, tmp_path / "lin.pth")
    cli = load_script("convert_weights")
    out = cli.main(
        [
            "lpips",
            "--vgg",
            str(tmp_path / "vgg.pth"),
            "--lin",
            str(tmp_path / "lin.pth"),
            "--out",
            str(tmp_path / "cli.npz"),
        ]
    )
    ours, theirs = nnx.to_pure_dict(nnx.state(load_lpips(out))), nnx.to_pure_dict(nnx.state(net))
    jax.tree.map(np.testing.assert_array_equal, ours, theirs)

"""The pixel-space text-to-image DiT: bottleneck patch embedding, adaLN-Zero blocks (RMSNorm, qk-norm, SwiGLU,
2D RoPE), caption tokens joined to image tokens in attention, optional TREAD routing and a REPA hook.

The sequence is [image tokens, text tokens] so that valid keys form a prefix of every row: attention takes
per-sample key lengths (cuDNN's fast path) instead of a dense mask.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from reve_jax.model import routing
from reve_jax.model.layers import (
    Attention,
    PatchEmbed,
    RMSNorm,
    SwiGLU,
    TimeEmbed,
    dense,
    grid_positions,
    rope_angles,
    sincos_position_embedding,
    swiglu_hidden,
    unpatchify,
)
from reve_jax.model.text import TextArgs, TextConditioner


@dataclasses.dataclass(frozen=True)
class RouteArgs:
    """TREAD: a random `keep_ratio` of the image tokens go through blocks [start, end) (end < 0 counts from depth)."""

    enabled: bool = False
    keep_ratio: float = 0.5
    start: int = 1
    end: int = -1


@dataclasses.dataclass(frozen=True)
class DDTArgs:
    """JIT-DDT's encoder tower: width, depth, heads, its coarse patch, and the downsampling of its x0 prediction."""

    enc_width: int = 256
    enc_depth: int = 2
    enc_heads: int = 4
    enc_patch: int = 8
    enc_downsample: int = 4


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """Everything the DiT is built from, explicitly (train_state.model_args maps a run config to it).

    in_channels: channels of the input the model denoises (3 for pixels, an autoencoder's latent channels);
    patch / bottleneck: the patch side and the bottleneck embedding's rank (0: a plain linear embedding);
    attention: auto | xla | cudnn; remat: none | block | dots; scan_layers: blocks stacked under lax.scan;
    text_stream: joint (the blocks update the caption tokens too, as MMDiT) | fixed (every block attends to the
    caption tokens as they enter the tower, as cross-attention does: the words never mix with each other);
    repa_block: the block whose tokens the model returns for REPA (-1: none); ddt: the encoder tower (arch ddt).
    """

    in_channels: int = 3
    width: int = 256
    depth: int = 6
    heads: int = 4
    patch: int = 4
    bottleneck: int = 64
    mlp_ratio: float = 4.0
    mlp_multiple_of: int = 16
    qk_norm: bool = True
    rope_theta: float = 100.0
    pos_embed: str = "none"
    norm_eps: float = 1e-6
    dtype: str = "bfloat16"
    param_dtype: str = "float32"
    attention: str = "auto"
    remat: str = "none"
    scan_layers: bool = False
    text_stream: str = "joint"
    repa_block: int = -1
    route: RouteArgs = RouteArgs()
    text: TextArgs = TextArgs()
    ddt: DDTArgs = DDTArgs()


def _dtype(name: str):
    return jnp.dtype(name)


def _remat(fn, remat: str):
    """`fn` applied directly, rematerialised whole, or keeping only matmul outputs (no batch dims)."""
    if remat == "block":
        return jax.checkpoint(fn)
    if remat == "dots":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    return fn


def run_blocks(
    graphdef, states, seq, c, angles, lengths, *, remat: str = "none", stacked: bool = False, n_update: int = -1
):
    """Applies blocks of structure `graphdef` in order to the joint sequence `seq`.

    `n_update` >= 0: each block updates only the first `n_update` tokens; the rest (the caption tokens of
    `model.text_stream` fixed) are keys and values in every block, as they entered the first, and cost no queries
    or MLP.

    `states`: a list of per-block states (unrolled: XLA compiles every block separately), or with `stacked` one
    state whose leaves carry a leading block axis (`model.scan_layers`): one block body under `lax.scan`, so the
    program, and its compile time, stop growing with depth.
    """

    def call(state, x):
        return nnx.merge(graphdef, state)(x, c, angles, lengths, n_update=n_update)

    call = _remat(call, remat)
    if stacked:
        seq, _ = jax.lax.scan(lambda x, state: (call(state, x), None), seq, states)
        return seq
    for state in states:
        seq = call(state, seq)
    return seq


class DiTBlock(nnx.Module):
    """adaLN-Zero transformer block: the conditioning vector sets shift/scale/gate of both sub-layers; the gates
    start at zero so every block starts as the identity."""

    def __init__(self, width: int, heads: int, mlp_hidden: int, *, qk_norm, eps, impl, rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.norm1 = RMSNorm(width, eps=eps, scale=False)
        self.attn = Attention(width, heads, qk_norm=qk_norm, eps=eps, impl=impl, **kw)
        self.norm2 = RMSNorm(width, eps=eps, scale=False)
        self.mlp = SwiGLU(width, mlp_hidden, **kw)
        self.adaln = dense(width, 6 * width, ("embed", "adaln"), init=nnx.initializers.zeros_init(), **kw)

    def __call__(
        self, x: jax.Array, c: jax.Array, angles: jax.Array, lengths: jax.Array, n_update: int = -1
    ) -> jax.Array:
        """`n_update` >= 0: only the first n_update tokens are updated (they alone are queries and go through the
        MLP); the rest serve as keys and values and come out as they came in."""
        mod = self.adaln(jax.nn.silu(c))[:, None, :]
        shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(mod, 6, axis=-1)
        h = self.norm1(x) * (1 + scale1) + shift1
        rest, n_query = None, None
        if 0 <= n_update < x.shape[1]:
            x, rest, n_query = x[:, :n_update], x[:, n_update:], n_update
        x = x + gate1 * self.attn(h, angles, lengths, n_query=n_query)
        h = self.norm2(x) * (1 + scale2) + shift2
        x = x + gate2 * self.mlp(h)
        return x if rest is None else jnp.concatenate([x, rest], axis=1)


class FinalLayer(nnx.Module):
    def __init__(self, width: int, out_dim: int, *, eps, rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.norm = RMSNorm(width, eps=eps, scale=False)
        self.adaln = dense(width, 2 * width, ("embed", "adaln"), init=nnx.initializers.zeros_init(), **kw)
        self.linear = dense(width, out_dim, ("embed", "patch"), init=nnx.initializers.zeros_init(), **kw)

    def __call__(self, x: jax.Array, c: jax.Array) -> jax.Array:
        shift, scale = jnp.split(self.adaln(jax.nn.silu(c))[:, None, :], 2, axis=-1)
        return self.linear(self.norm(x) * (1 + scale) + shift)


class DiT(nnx.Module):
    """Maps (noisy input z [B,H,W,C], time t [B], caption) to the network output [B,H,W,C] in float32, C =
    args.in_channels.

    `tower` overrides the width/depth/heads/patch of `args` for the JIT-DDT encoder tower. `out_patch` is the output
    pixels per token side (the encoder tower predicts a downsampled image); `with_text_encoder=False` makes a tower
    that takes caption features from another.
    """

    def __init__(
        self,
        args: ModelArgs,
        *,
        rngs: nnx.Rngs,
        tower: dict | None = None,
        out_patch: int | None = None,
        with_text_encoder: bool = True,
        routing_allowed: bool = True,
    ):
        m = args
        shape = dict(width=m.width, depth=m.depth, heads=m.heads, patch=m.patch, bottleneck=m.bottleneck)
        shape.update(tower or {})
        width, depth, heads = shape["width"], shape["depth"], shape["heads"]
        dtype, param_dtype = _dtype(m.dtype), _dtype(m.param_dtype)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.patch = shape["patch"]
        self.out_patch = out_patch or self.patch
        self.head_dim = width // heads
        self.rope_theta = m.rope_theta
        self.pos_embed = m.pos_embed
        self.remat = m.remat
        self.scan_layers = m.scan_layers
        self.text_stream = m.text_stream
        self.repa_block = m.repa_block if routing_allowed else -1
        self.route = m.route.enabled and routing_allowed
        self.route_keep_ratio = m.route.keep_ratio
        self.route_start, self.route_end = (
            routing.route_span(depth, m.route.start, m.route.end) if self.route else (0, 0)
        )

        channels = m.in_channels
        self.patch_embed = PatchEmbed(self.patch, width, shape["bottleneck"], channels=channels, **kw)
        self.time_embed = TimeEmbed(width, **kw)
        self.text = TextConditioner(m.text, width, eps=m.norm_eps, with_encoder=with_text_encoder, **kw)
        hidden = swiglu_hidden(width, m.mlp_ratio, m.mlp_multiple_of)
        block_kw = dict(qk_norm=m.qk_norm, eps=m.norm_eps, impl=m.attention, dtype=dtype, param_dtype=param_dtype)
        if self.scan_layers:  # one module whose parameters carry a leading `layers` axis (depth blocks)

            @nnx.split_rngs(splits=depth)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def stacked_blocks(block_rngs):
                return DiTBlock(width, heads, hidden, rngs=block_rngs, **block_kw)

            self.blocks = stacked_blocks(rngs)
        else:
            self.blocks = nnx.List([DiTBlock(width, heads, hidden, rngs=rngs, **block_kw) for _ in range(depth)])
        self.depth = depth
        self.final = FinalLayer(width, self.out_patch * self.out_patch * channels, eps=m.norm_eps, **kw)

    def __call__(
        self,
        z: jax.Array,
        t: jax.Array,
        text: dict,
        *,
        drop: jax.Array | None = None,
        route_key: jax.Array | None = None,
    ) -> tuple[jax.Array, dict]:
        """Returns (output [B,H,W,3] float32, aux). `route_key` turns TREAD on (training, or routed guidance);
        aux holds `repa` (image tokens after block `repa_block`, the kept ones when routed; the objective's REPA head
        projects them) and `repa_idx` (their token indices [B, n])."""
        out, _, aux = self.forward(z, t, text, drop=drop, route_key=route_key)
        return out, aux

    def forward(self, z, t, text, *, drop=None, route_key=None, feats=None, extra=None):
        """The tower: returns (output image, final image tokens [B, N, W], aux). `feats` are caption features
        from another tower's encoder; `extra` = (tokens [B, M, W], positions [B, M, 2] in this tower's patch
        units) joins the sequence after the image tokens and before the text (the DDT plan tokens)."""
        b, h, w, _ = z.shape
        x = self.patch_embed(z)
        n = x.shape[1]
        txt, lengths, pooled = self.text(text, drop, feats)
        c = self.time_embed(t) if pooled is None else self.time_embed(t) + pooled
        if extra is not None:
            # Plan tokens ride with the text: never routed, always attended, with their own 2D positions.
            txt = jnp.concatenate([extra[0].astype(txt.dtype), txt], axis=1)
            lengths = lengths + extra[0].shape[1]
        grid = grid_positions(h, w, self.patch)
        if self.pos_embed == "sincos":  # absolute positions beside RoPE's relative ones (JiT)
            x = x + sincos_position_embedding(grid, x.shape[-1]).astype(x.dtype)[None]
        pos = jnp.broadcast_to(grid[None], (b, n, 2))
        ctx_angles = jnp.zeros((b, txt.shape[1], self.head_dim // 2), jnp.float32)
        if extra is not None:
            plan_angles = rope_angles(extra[1], self.head_dim, self.rope_theta)
            ctx_angles = ctx_angles.at[:, : extra[1].shape[1]].set(plan_angles)

        def angles_for(p):
            return jnp.concatenate([rope_angles(p, self.head_dim, self.rope_theta), ctx_angles], axis=1)

        routed = self.route and route_key is not None
        idx = jnp.broadcast_to(jnp.arange(n)[None], (b, n))
        full_img, angles = None, angles_for(pos)
        aux = {}
        # Blocks run in segments between the points where the token set changes (TREAD's span) or is read (REPA);
        # within a segment the joint [image, text] sequence stays joined.
        depth = self.depth
        cuts = {0, depth, self.repa_block + 1} | ({self.route_start, self.route_end} if routed else set())
        cuts = sorted(i for i in cuts if 0 <= i <= depth)
        for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
            if routed and lo == self.route_start:
                keep = routing.keep_count(n, self.route_keep_ratio)
                idx = routing.sample_keep_indices(route_key, b, n, keep)
                full_img, x = x, routing.gather_tokens(x, idx)
                angles = angles_for(routing.gather_tokens(pos, idx))
            if routed and lo == self.route_end:
                x = routing.scatter_tokens(full_img, x, idx)
                idx = jnp.broadcast_to(jnp.arange(n)[None], (b, n))
                angles = angles_for(pos)
            n_img = x.shape[1]
            seq = jnp.concatenate([x, txt.astype(x.dtype)], axis=1)
            if self.scan_layers:
                graphdef, stacked = nnx.split(self.blocks)
                states = jax.tree.map(lambda a, lo=lo, hi=hi: a[lo:hi], stacked)
            else:
                graphdef, states = nnx.graphdef(self.blocks[lo]), [nnx.state(self.blocks[i]) for i in range(lo, hi)]
            seq = run_blocks(
                graphdef,
                states,
                seq,
                c,
                angles,
                lengths + n_img,
                remat=self.remat,
                stacked=self.scan_layers,
                n_update=n_img if self.text_stream == "fixed" else -1,
            )
            x, txt = seq[:, :n_img], seq[:, n_img:]
            if hi - 1 == self.repa_block:
                aux["repa"] = x
                aux["repa_idx"] = idx
        if routed and self.route_end == depth:
            x = routing.scatter_tokens(full_img, x, idx)
        out = self.final(x, c)
        scale = self.out_patch / self.patch
        image = unpatchify(out.astype(jnp.float32), self.out_patch, int(h * scale), int(w * scale))
        return image, x, aux


class DDT(nnx.Module):
    """JIT-DDT: an encoder tower on coarse patches predicts x0 at low resolution (its own loss) and its final
    tokens enter the decoder's sequence as plan tokens; the decoder predicts x0 at full resolution.

    Output as DiT's, plus `aux["enc_out"]`: the encoder's prediction [B, H/d, W/d, 3], d = model.ddt.enc_downsample.
    """

    def __init__(self, args: ModelArgs, *, rngs: nnx.Rngs):
        m, d = args, args.ddt
        dtype, param_dtype = _dtype(m.dtype), _dtype(m.param_dtype)
        self.enc_patch, self.dec_patch = d.enc_patch, m.patch
        self.decoder = DiT(args, rngs=rngs)
        self.encoder = DiT(
            args,
            rngs=rngs,
            with_text_encoder=False,
            routing_allowed=False,
            tower=dict(width=d.enc_width, depth=d.enc_depth, heads=d.enc_heads, patch=d.enc_patch),
            out_patch=d.enc_patch // d.enc_downsample,
        )
        self.plan_proj = dense(
            d.enc_width, m.width, ("embed", "embed"), rngs=rngs, dtype=dtype, param_dtype=param_dtype
        )

    def __call__(self, z, t, text, *, drop=None, route_key=None):
        b, h, w, _ = z.shape
        feats = self.decoder.text.features(text)
        enc_out, plan, _ = self.encoder.forward(z, t, text, drop=drop, feats=feats)
        # Plan token (i, j) covers decoder patches [i*r, (i+1)*r): place it at their centre.
        r = self.enc_patch / self.dec_patch
        grid = grid_positions(h, w, self.enc_patch).astype(jnp.float32) * r + (r - 1) / 2
        plan_pos = jnp.broadcast_to(grid[None], (b,) + grid.shape)
        out, _, aux = self.decoder.forward(
            z, t, text, drop=drop, route_key=route_key, feats=feats, extra=(self.plan_proj(plan), plan_pos)
        )
        return out, dict(aux, enc_out=enc_out)


def stack_blocks(params: dict) -> dict:
    """Converts a pure-dict params tree (`nnx.to_pure_dict`) from the per-block layout (`blocks/<i>/...`) to the
    stacked one of `model.scan_layers=True` (`blocks/...` with a leading block axis); e.g. to resume a checkpoint's
    weights under the other layout. Other parts of the tree (the text encoder's own blocks too) are unchanged."""
    return _map_towers(params, lambda blocks: jax.tree.map(lambda *xs: jnp.stack(xs), *_in_order(blocks)))


def unstack_blocks(params: dict) -> dict:
    """The inverse of `stack_blocks`: `blocks/...` [depth, ...] -> `blocks/<i>/...`."""

    def split(stacked):
        depth = jax.tree.leaves(stacked)[0].shape[0]
        return {i: jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(depth)}

    return _map_towers(params, split)


def _in_order(blocks: dict) -> list:
    keys = sorted(blocks, key=int)
    if [int(k) for k in keys] != list(range(len(keys))):
        raise ValueError(f"expected blocks 0..n-1 in the per-block layout, got keys {keys}")
    return [blocks[k] for k in keys]


def _map_towers(params: dict, fn) -> dict:
    out = dict(params)
    if "blocks" in out:  # a DiT
        out["blocks"] = fn(out["blocks"])
    for tower in ("decoder", "encoder"):  # a DDT
        if tower in out and "blocks" in out[tower]:
            out[tower] = {**out[tower], "blocks": fn(out[tower]["blocks"])}
    return out

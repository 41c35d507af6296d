"""The DiT sizes of the throughput benchmark in pixel space.

DiT's latent 32x32 grid at patch 2 is 256 tokens; in pixel space that is 256 px at patch 16. A plain linear patch
embedding (bottleneck 0) and a GELU-equivalent SwiGLU (mlp_ratio 4) match DiT's block FLOPs. One-object captions
(13 tokens, max_len 16) keep the text tokens that ride along in every block to 6% of the sequence. TREAD (off
unless --tread on) routes blocks [2, depth-2), as the plain JAX reference step in docs/performance.md did.
"""

from configs import base
from reve_jax.config import apply_override


def dit(width: int, depth: int, heads: int, batch: int = 256):
    c = base.get_config()
    c.name = f"dit_w{width}_d{depth}"
    for item in (
        "model.patch=16",
        "model.bottleneck=0",
        "model.mlp_ratio=4.0",
        "model.rope_theta=10000.0",
        "data.image_size=256",
        "data.max_objects=1",
        "text.max_len=16",
        "model.route.start=2",
        "model.route.end=-2",
        f"model.width={width}",
        f"model.depth={depth}",
        f"model.heads={heads}",
        f"train.global_batch={batch}",
    ):
        apply_override(c, item)
    return c

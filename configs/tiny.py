"""The CPU default: a small DiT on 32 px one-object synthetic scenes, trained with the recipe in about 9 minutes
on 2 cores.

python scripts/train.py --config configs/tiny.py --workdir runs/tiny

The recipe's pieces that pay at this size (docs/tiny.md has every probe and its numbers): JiT's x-prediction with
the loss in v-space and its fixed sine-cosine position embedding beside RoPE, the bottleneck patch embedding, Muon on
the hidden 2D weights (AdamW for the rest), a cosine decay, an EMA with warm-up. Left out, measured: REPA to the
project's feature network (a 40% slower step for +0.06 alignment), 64 px at patch 8 (worse). TREAD and the DDT
towers are not used at 64 tokens per image.

The data is what a 10-minute run can learn: one object per image, rendered `fixed` (centered in its cell at one of
two exact sizes, upright, on a flat background; `jitter` varies all of these and scored 0.29 in the same time).
Guidance 2: from 3 up, objects start to vanish at this size.
"""

from configs import base


def get_config():
    c = base.get_config()
    c.name = "tiny"
    c.model.width = 128
    c.model.depth = 4
    c.model.heads = 4
    c.model.patch = 4
    c.model.bottleneck = 32
    c.model.pos_embed = "sincos"
    c.model.dtype = "float32"  # bf16 matmuls are slow on CPU
    c.text.width = 64
    c.text.depth = 1
    c.text.heads = 2
    c.text.max_len = 16  # a one-object caption is at most 13 tokens
    c.data.image_size = 32
    c.data.max_objects = 1
    c.data.render = "fixed"
    c.diffusion.t_mean = -0.4
    c.optim.name = "muon"  # at lr 2e-3 it diverged (docs/tiny.md)
    c.optim.lr = 1e-3
    c.optim.schedule = "cosine"
    c.optim.warmup_steps = 50
    c.train.global_batch = 32
    c.train.steps = 2000
    c.train.log_every = 25
    c.train.sample_every = 1000
    c.train.ckpt_every = 1000
    c.ema.decays = (0.995,)
    c.sample.steps = 20
    c.sample.cfg_scale = 2.0
    c.sample.num = 16
    return c

"""The CPU default: a small DiT on 32 px synthetic captioned shapes, trains in minutes on 2 cores.

python scripts/train.py --config configs/tiny.py --workdir runs/tiny
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
    c.model.pos_embed = "sincos"  # JiT's fixed absolute positions beside RoPE: "in the center" is where, not relative
    c.model.dtype = "float32"  # bf16 matmuls are slow on CPU
    c.text.width = 64
    c.text.depth = 1
    c.text.heads = 2
    c.text.max_len = 32
    c.data.image_size = 32
    c.diffusion.t_mean = -0.4
    c.optim.lr = 1e-3
    c.optim.warmup_steps = 50
    c.train.global_batch = 32
    c.train.steps = 1500
    c.train.log_every = 25
    c.train.sample_every = 500
    c.train.ckpt_every = 500
    c.ema.decays = (0.995,)
    c.sample.steps = 20
    c.sample.num = 16
    return c

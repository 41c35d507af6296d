"""JiT-B/16 at 256 px (docs/recipe.md section 1): depth 12, width 768, 12 heads, patch 16, bottleneck 128,
x-prediction with v-loss, logit-normal(-0.8, 0.8), Adam (0.9, 0.95), lr 2e-4 at batch 1024, two EMAs.

    python scripts/train.py --config configs/jit_b16.py --workdir runs/jit_b16
"""

from configs import base


def get_config():
    c = base.get_config()
    c.name = "jit_b16"
    c.model.width = 768
    c.model.depth = 12
    c.model.heads = 12
    c.model.patch = 16
    c.model.bottleneck = 128
    c.model.rope_theta = 10_000.0
    c.model.pos_embed = "sincos"  # JiT adds a fixed sine-cosine embedding besides RoPE
    c.data.image_size = 256
    c.text.max_len = 32
    c.diffusion.t_mean = -0.8
    c.diffusion.t_std = 0.8
    c.diffusion.noise_scale = 1.0
    c.optim.lr = 2e-4  # blr 5e-5 * 1024 / 256
    c.optim.warmup_steps = 6_250  # 5 epochs of ImageNet at batch 1024
    c.optim.clip_norm = 0.0
    c.train.global_batch = 1024
    c.train.steps = 500_000
    c.train.log_every = 100
    c.train.sample_every = 10_000
    c.train.ckpt_every = 2_000
    c.ema.decays = (0.9999, 0.9996)
    c.sample.steps = 50
    c.sample.cfg_interval = (0.1, 1.0)
    c.mesh.fsdp = -1
    c.mesh.data = 1
    return c

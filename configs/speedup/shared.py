"""What the speedup sizes share: the protocol's settings for every run, and the CPU sizes' model."""

# A cosine LR decayed to 0 over the run (No Train No Gain), no sample grids during the run, one checkpoint kept
# (the benchmark checkpoints at every evaluation, so a killed benchmark resumes), the sampler fixed across methods.
COMMON_TRAIN = (
    "optim.schedule='cosine'",
    "optim.min_lr_ratio=0.0",
    "train.sample_every=0",
    "train.stop_on_nan=True",
    "train.ckpt_keep=1",
    "sample.sampler='euler'",
    # The blocks update the caption tokens beside the image tokens, as every size was calibrated and swept (the
    # default of configs/base.py; configs/tiny.py's fixed stream came after). Text handling is not a compared technique.
    "model.text_stream='joint'",
)


def cpu_model(image_size: int, patch: int) -> tuple[str, ...]:
    """A 3-block, width-128 DiT on one-object scenes (16 caption tokens), of the fixed rendering unless a size's
    data overrides it (cpu30 and cpu64 use the jittered one)."""
    return (
        "model.width=128",
        "model.depth=3",
        "model.heads=4",
        f"model.patch={patch}",
        "text.width=64",
        "text.depth=1",
        "text.heads=2",
        "text.max_len=16",
        f"data.image_size={image_size}",
        "data.max_objects=1",
        "data.render='fixed'",  # the `cpu` size's data under the first protocol (shape is learned in its budget)
        *CPU_AUTOENCODER,
    )


# Baseline A's autoencoder at the CPU sizes: 2x down to 8 channels (16x16x8 latents of a 32 px image), the least
# downsampling whose reconstructions keep the small objects' shapes for the benchmark's check. The decoder trains on
# latents with noise of 0.4 their std, so that a DiT's slightly-off latents still decode to clean objects: the most
# noise tried whose reconstructions still pass the check. Trained once per data setting (docs/latent.md).
CPU_AUTOENCODER = (
    "latent.downsample=2",
    "latent.channels=8",
    "latent.width=16",
    "latent.train_noise=0.4",
    "latent.train_lr=4e-3",
    "latent.train_steps=12000",
    "latent.train_batch=32",
)


def cpu_train(batch: int) -> tuple[str, ...]:
    """Training settings of the CPU sizes."""
    return (
        *COMMON_TRAIN,
        "data.worker_threads=1",
        f"train.global_batch={batch}",
        "optim.warmup_steps=50",
        "ema.decays=(0.99,)",
        "sample.steps=12",
    )

"""The base config: every key reve_jax reads, with its default and what it means.

Experiment files start from `get_config()` here and override what they change. Nothing else in the project
adds keys: an unknown key on the command line or in an experiment file is an error.
"""

import ml_collections

# Logical axis name -> mesh axes. Params are FSDP-sharded on their width dimension and tensor-parallel on heads/mlp.
DEFAULT_RULES = (
    ("batch", ("data", "fsdp")),  # activations and data: batch over every data-parallel axis
    ("embed", "fsdp"),  # model width
    ("mlp", "tensor"),  # MLP hidden dimension
    ("heads", "tensor"),  # attention heads * head_dim
    ("adaln", "tensor"),  # adaLN modulation outputs (6 * width)
    ("vocab", None),
    ("patch", None),  # p*p*3 pixels of a patch
    ("bottleneck", None),
    ("text_embed", None),  # width of precomputed text embeddings
    ("repa", None),
)


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # seeds parameters, noise, time sampling and the data order
    c.name = "base"  # run name used in logs

    c.model = m = ml_collections.ConfigDict()
    m.arch = "dit"  # dit | ddt (JIT-DDT encoder-decoder)
    m.width = 256  # hidden size
    m.depth = 6  # transformer blocks
    m.heads = 4  # attention heads; must divide width
    m.mlp_ratio = 4.0  # SwiGLU hidden = round(mlp_ratio * width * 2/3) rounded to mlp_multiple_of
    m.mlp_multiple_of = 16  # SwiGLU hidden size rounded up to this multiple
    m.patch = 4  # patch size in pixels
    m.bottleneck = 64  # bottleneck patch embedding rank r (p*p*3 -> r -> width); 0 = plain linear embedding
    m.qk_norm = True  # RMSNorm on queries and keys
    m.rope_theta = 100.0  # base of the 2D rotary embedding over the patch grid
    m.pos_embed = "none"  # none | sincos (a fixed 2D sine-cosine embedding added to the image tokens, as JiT)
    m.norm_eps = 1e-6
    m.dtype = "bfloat16"  # compute dtype; params stay in param_dtype
    m.param_dtype = "float32"
    m.attention = "auto"  # auto (cudnn on GPU, xla elsewhere) | xla | cudnn
    m.remat = "none"  # none | block (recompute each block in the backward pass) | dots (keep matmul outputs only)
    m.scan_layers = False  # blocks stored stacked (leading `layers` axis) and run under lax.scan: compile time flat
    # joint: the blocks update the caption tokens beside the image tokens (MMDiT) | fixed: every block attends to the
    # caption tokens as they enter the tower (cross-attention in effect; the words never mix with each other)
    m.text_stream = "joint"
    # TREAD token routing (training only): a random keep_ratio of image tokens go through blocks [start, end).
    m.route = ml_collections.ConfigDict()
    m.route.enabled = False
    m.route.keep_ratio = 0.5
    m.route.start = 1  # first routed block (inclusive)
    m.route.end = -1  # end block (exclusive); negative counts from depth
    # JIT-DDT: an encoder tower on coarse patches whose final tokens join the decoder's sequence as plan tokens.
    m.ddt = ml_collections.ConfigDict()
    m.ddt.enc_depth = 2
    m.ddt.enc_width = 256
    m.ddt.enc_heads = 4
    m.ddt.enc_patch = 8  # coarse patch size of the encoder tower (must be a multiple of model.patch)
    m.ddt.enc_downsample = 4  # the encoder predicts x0 at image_size / enc_downsample (Linum: 1/8 at 512 px)
    m.ddt.enc_loss_weight = 1.0
    m.repa_block = -1  # block whose tokens the model returns for REPA (-1: none)

    c.text = t = ml_collections.ConfigDict()
    t.encoder = "builtin"  # builtin (trainable, built-in tokenizer) | precomputed (batch carries text_emb)
    t.max_len = 32  # tokens per caption (padding/truncation)
    t.width = 128  # built-in text encoder width
    t.depth = 2  # built-in text encoder blocks (0: the word and position embeddings alone, each word apart)
    t.heads = 4
    t.emb_dim = 384  # width of precomputed embeddings (text.encoder=precomputed)
    t.pooled = True  # the caption's mean feature also joins the time embedding (False: through attention alone)
    # The frozen encoder that made the precomputed embeddings (minilm | t5 | t5gemma | qwen), so that sampling can
    # encode new prompts the same way; filled from the shards' manifest when empty.
    t.frozen_encoder = ""
    t.frozen_encoder_path = ""  # its weights directory ("" = MiniLM's packaged weights)

    c.data = d = ml_collections.ConfigDict()
    d.name = "synthetic"  # synthetic | shards
    d.image_size = 32
    d.seed = 0  # dataset content seed (independent of c.seed so runs can vary while data stays fixed)
    d.num_samples = 1_000_000  # size of the index space; the order is a fresh permutation each epoch
    d.max_objects = 3
    d.min_objects = 1  # each synthetic image has min_objects..max_objects objects
    d.shapes = ()  # synthetic shapes drawn from (names from circle, square, triangle, diamond, cross); () = all
    d.colors = ()  # synthetic palette for backgrounds and objects (at least 2 of the 8 names); () = all
    d.render = "jitter"  # jitter (each caption a distribution of images) | fixed (one image per caption, as before)
    # Compositions the training stream never shows (data/synthetic/split.py): this share of the (color, shape) and of
    # the (shape, cell) pairs, chosen by heldout_seed alone; evaluation scores captions that contain one ("unseen")
    # beside training-like ones ("seen"). 0 trains on every composition (then only "seen" can be scored).
    d.heldout_frac = 0.15
    d.heldout_seed = 0
    # Training captions only: the chance that a caption leaves out each object's size, color, shape or position word
    # (each apart), so each word is also learned without the others; 0 states every attribute.
    d.caption_drop = 0.0
    # Training images of the fixed rendering only: each object's center moves up to this many pixels (each axis) from
    # its cell's center, so each shape is seen at every sub-patch position; 0 draws one image per caption.
    d.shift = 0.0
    d.path = ""  # shards directory (data.name=shards)
    d.worker_threads = 2  # grain read threads per process (each builds whole batches)
    d.worker_processes = 0  # grain worker processes (0: none); for hosts where the GIL-bound decode starves the step
    d.prefetch = 2  # batches prefetched ahead of the step
    d.stages = ()  # resolution stages ((start_step, shards dir | image size), ...), first at 0; () = one stage

    c.diffusion = f = ml_collections.ConfigDict()
    f.prediction = "x"  # what the network outputs: x | v | eps
    f.loss_space = "v"  # where the loss is measured: x | v | eps
    f.t_sampler = "logit_normal"  # logit_normal | uniform
    f.t_mean = -0.8  # logit-normal location (JiT, t=1 clean: negative biases to noise)
    f.t_std = 0.8
    f.t_shift = 1.0  # resolution shift s: t -> t / (t + s*(1-t)) in the clean direction (1 = none)
    f.t_uniform_frac = 0.0  # share of samples drawn uniformly
    f.t_eps = 0.05  # clamp of (1-t) when dividing: v = (x - z) / max(1-t, t_eps)
    f.noise_scale = 1.0  # eps scale (JiT: 1 at 256 px, 2 at 512 px)
    f.caption_drop = 0.1  # probability of training a sample unconditionally (for CFG)

    # Losses on the predicted image x_hat besides the flow-matching loss (docs/recipe.md section 2). The frozen networks
    # load from converted files (scripts/convert_weights.py); nothing is downloaded.
    c.loss = lo = ml_collections.ConfigDict()
    lo.lpips_weight = 0.0  # PRX and Linum: 0.1
    lo.lpips_path = ""  # converted VGG16-LPIPS .npz
    lo.lpips_downscale = 0.5  # both images resized by this before LPIPS
    lo.dino_weight = 0.0  # PRX and Linum: 0.01 (1 - cos between DINOv2 patch tokens of x_hat and x)
    lo.dino_path = ""  # converted DINOv2 .npz (ViT-B/14 with registers in the recipe)
    lo.dino_size = 224  # images resized to this for DINOv2
    # What the dino term compares: dinov2 (patch tokens of loss.dino_path) | features (the per-cell embeddings of the
    # project's own feature network of the procedural dataset, perceptual/shapes.py: no downloaded weights)
    lo.dino_target = "dinov2"
    lo.repa_weight = 0.0  # PRX: 0.5, Linum: 0.1; aligns block model.repa_block's tokens to features of x
    # What REPA aligns to: dinov2 (patch tokens of loss.dino_path) | features (the project's own feature network of
    # the procedural dataset, perceptual/shapes.py: no downloaded weights, for the CPU benchmarks)
    lo.repa_target = "dinov2"
    lo.repa_dim = 768  # the target's width (the REPA projector's output); checked against the network
    lo.repa_hidden = 1024  # REPA projector MLP hidden width
    lo.perceptual_t_min = 0.0  # LPIPS/DINO only where t >= this (t=1 clean); Linum's "t <= 0.7 noise" is 0.3
    lo.perceptual_dtype = "bfloat16"  # compute dtype of the frozen networks

    # Latent diffusion (docs/latent.md): with `path` set the model denoises a frozen autoencoder's normalised latents
    # instead of pixels; the batch still carries pixels and the train step encodes them. The rest sizes and trains
    # the autoencoder (scripts/train_autoencoder.py).
    c.latent = lt = ml_collections.ConfigDict()
    lt.path = ""  # autoencoder weights (.npz); "" = pixel space
    lt.channels = 16  # latent channels (checked against the file)
    lt.downsample = 4  # pixels per latent cell side, a power of 2 (checked against the file)
    lt.width = 32  # the autoencoder's stem channels (doubling per level, up to 4x)
    lt.res_blocks = 0  # residual blocks per level and in the middle (docs/latent.md)
    lt.train_steps = 3000
    lt.train_batch = 64
    lt.train_lr = 2e-3
    # the rendering the autoencoder trains on ("" = data.render): a fixed-rendering run can use the autoencoder of
    # the jittered one (its images are among the jittered ones), checked again on the run's own images
    lt.train_render = ""
    lt.train_noise = 0.1  # std of the noise added to latents while training the decoder (x the latents' std)
    lt.latent_l2 = 1e-4  # weight of the L2 pull on the raw latents
    lt.l1_weight = 0.0  # weight of an L1 reconstruction term beside the MSE (sharper edges)

    c.optim = o = ml_collections.ConfigDict()
    o.name = "adamw"  # adamw | muon (Muon for 2D hidden block weights, AdamW for the rest)
    o.lr = 2e-4  # peak learning rate (AdamW group; also Muon's unless muon_lr > 0)
    o.b1 = 0.9
    o.b2 = 0.95
    o.eps = 1e-8
    o.weight_decay = 0.0
    o.schedule = "constant"  # constant | cosine | linear (decay to min_lr_ratio*lr after warm-up) | wsd (below)
    o.decay_frac = 0.2  # wsd: constant, then a linear decay to min_lr_ratio*lr over this last share of the steps
    o.warmup_steps = 100
    o.min_lr_ratio = 0.0
    o.clip_norm = 1.0  # global gradient norm clip; 0 disables
    o.muon_lr = 0.0  # Muon group lr; 0 = use lr
    o.muon_momentum = 0.95
    o.muon_nesterov = True
    o.muon_ns_steps = 5
    o.muon_scale = "moonlight"  # moonlight (0.2*sqrt(max(m,n)), AdamW lr carries over) | keller (sqrt(max(1,m/n)))
    o.muon_weight_decay = 0.0
    # Param paths (full match) given to Muon: attention and MLP kernels of the DiT blocks (and of both DDT towers).
    o.muon_patterns = (r"((encoder|decoder)/)?blocks/(\d+/)?(attn/(q|k|v|out)|mlp/(gate|up|down))/kernel",)

    c.ema = ml_collections.ConfigDict()
    c.ema.decays = (0.999,)  # one EMA of the parameters per decay; the first is used for sampling
    # Warm-up: the n-th update uses min(decay, (1 - 1/n)^(1 + warmup_power)), an average over roughly the last
    # 1/(1 + warmup_power) of the steps so far, until the fixed decay averages less; < 0 = off (fixed decay).
    c.ema.warmup_power = 7.0

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # -1 takes the devices left after the other axes
    c.mesh.fsdp = 1
    c.mesh.tensor = 1
    c.mesh.rules = DEFAULT_RULES  # logical axis -> mesh axes

    c.train = tr = ml_collections.ConfigDict()
    tr.global_batch = 64  # samples per optimizer step across all processes (fixed when the mesh changes)
    tr.grad_accum = 1  # micro-batches per step (the global batch is split, not multiplied)
    tr.steps = 1000
    tr.log_every = 10  # metrics to metrics.jsonl and TensorBoard
    tr.sample_every = 500  # sample grid PNG (0: only at the end)
    tr.ckpt_every = 250  # checkpoint cadence in steps
    tr.ckpt_keep = 3  # checkpoints kept
    tr.ckpt_async = True
    # Copy the checkpoint off the device behind the next step (checkpoint.Checkpointer.stage): the save blocks for
    # a device-side copy instead of the whole device-to-host transfer, for one more copy of the state in device
    # memory at checkpoint steps. Off until measured on the GPU (docs/performance.md).
    tr.ckpt_overlap = False
    tr.stop_on_nan = True
    tr.peak_tflops = 0.0  # device peak for MFU; 0 = 989 on H100/H200, a measured matmul peak on CPU
    tr.compile_cache = ""  # persistent XLA compilation cache directory ("" = off, or $JAX_COMPILATION_CACHE_DIR)

    # Elastic runs (docs/elastic.md): how a failure is recovered from besides the disk checkpoints.
    c.elastic = el = ml_collections.ConfigDict()
    el.snapshot_every = 0  # in-memory snapshot of the train state every N steps, also held by the next host (0: off)
    el.snapshot_dir = ""  # host-local directory for them ("" = /dev/shm/reve_jax: host memory, survives the process)

    c.sample = s = ml_collections.ConfigDict()
    s.sampler = "heun"  # euler | heun
    s.steps = 32
    s.cfg_scale = 3.0
    s.cfg_interval = (0.0, 1.0)  # apply CFG only for t in [lo, hi] (JiT's guidance interval)
    # x-prediction: the sampler's velocity (x_hat - z) / max(1 - t, t_eps). 0 = exact, every step lands where the flow
    # does (the last on x_hat); -1 = training's clamp diffusion.t_eps (JiT's sampler), which under-steps each step
    # that starts past t = 1 - diffusion.t_eps and leaves noise in the image
    s.t_eps = 0.0
    s.route_guidance = 0.0  # routed self-guidance s: out = routed + s*(full - routed); 0 = off
    s.num = 16  # images in the training sample grid (0: none)
    s.score_num = 64  # held-out captions the reader scores at each sample step and at the end (synthetic; 0 = off)
    s.seed = 1234  # fixed noise seed for sample grids
    s.use_ema = True
    c.lock()  # experiment files and overrides may change values, never add keys
    return c

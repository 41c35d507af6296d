"""The Grain input pipeline: a fixed global sample order, sliced per process, resumable from one integer.

Position semantics. The data position is the number of samples consumed in a fixed global order. Global
position k reads sample `order(k)`: epoch e = k // num_samples is a permutation of [0, num_samples) chosen by
(data.seed, e). Global batch g holds positions [g*B, (g+1)*B); process p of n reads its rows
[p*B/n, (p+1)*B/n), so local element j of global batch g is position g*B + p*(B/n) + j. Nothing depends on n,
so a run can resume at the same position on any process count that divides B.

The permutation is a keyed Feistel network on the smallest even-bit domain covering num_samples, with
cycle-walking back into range: a stateless bijection that costs O(1) per position, needs no per-epoch table
(num_samples can be 1e6 or more) and is thread-safe because nothing is cached.

Batches are dicts of numpy arrays (see docs/architecture.md) with no strings, so they can go to the device
as they are. Captions and structured descriptions are read beside the batch from its `index` key:
`captions_of(dataset_from_config(cfg.data), batch["index"])` or `dataset.scene(i)`.

Prepared shards (data.name="shards", see docs/data.md) read through the same positions. Records that carry
frozen-encoder embeddings give `text_emb` f32 [b,L,D] + `text_mask` instead of `tokens`. Shards prepared with
aspect buckets give one bucket per global batch (`BucketOrder`), so batch shapes vary by batch. `data.stages`
switches datasets (e.g. 512 px then 1024 px shards) at given steps; a stage reads its data from its own
position 0, and the data position stays one integer.
"""

import bisect
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grain
import numpy as np

from reve_jax.config import CHOICES
from reve_jax.data import shards, synthetic, tokenizer
from reve_jax.data.synthetic import split

Dataset = synthetic.SyntheticShapes | shards.ShardSource

_GOLDEN = 0x9E3779B97F4A7C15
_ROUNDS = 6


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wrapping arithmetic is intended)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class GlobalOrder:
    """Maps global positions to sample indices: a fresh pseudo-random permutation per epoch.

    Args:
      num_samples: size of the index space N.
      seed: data seed; (seed, epoch) selects the epoch's permutation.
    Call with an int array of positions (>= 0); returns int64 sample indices of the same shape.
    """

    def __init__(self, num_samples: int, seed: int):
        if num_samples < 1:
            raise ValueError(f"data.num_samples={num_samples}: need at least 1")
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        # Feistel halves of h bits each: the domain 4**h is the smallest one >= N, so cycle-walking takes
        # fewer than 4 passes on average.
        self._half_bits = max(1, ((self.num_samples - 1).bit_length() + 1) // 2)

    def _round_keys(self, epoch: int) -> list[np.uint64]:
        base = _mix64(np.array([self.seed & (2**64 - 1)], np.uint64))
        keys = []
        for r in range(_ROUNDS):
            salt = (epoch * _ROUNDS + r + 1) * _GOLDEN & (2**64 - 1)
            keys.append(_mix64(base ^ np.uint64(salt))[0])
        return keys

    def _permute_domain(self, x: np.ndarray, keys: list[np.uint64]) -> np.ndarray:
        h = np.uint64(self._half_bits)
        mask = np.uint64((1 << self._half_bits) - 1)
        left, right = x >> h, x & mask
        for k in keys:
            left, right = right, left ^ (_mix64(right ^ k) & mask)
        return (left << h) | right

    def permute(self, offsets: np.ndarray, epoch: int) -> np.ndarray:
        """Applies epoch `epoch`'s permutation of [0, N) to `offsets` (ints in [0, N)); returns int64."""
        keys = self._round_keys(epoch)
        y = self._permute_domain(np.asarray(offsets, np.uint64).reshape(-1), keys)
        # Cycle-walking: re-apply until the value lands in [0, N). This restricts the domain bijection to a
        # bijection of [0, N).
        out = y >= np.uint64(self.num_samples)
        while out.any():
            y[out] = self._permute_domain(y[out], keys)
            out = y >= np.uint64(self.num_samples)
        return y.astype(np.int64).reshape(np.shape(offsets))

    def __call__(self, positions: np.ndarray | int) -> np.ndarray:
        pos = np.asarray(positions, np.int64)
        if (pos < 0).any():
            raise ValueError("data positions must be >= 0")
        epochs, offsets = np.divmod(pos.reshape(-1), self.num_samples)
        result = np.empty(epochs.shape, np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            result[sel] = self.permute(offsets[sel], int(e))
        return result.reshape(pos.shape)


def _check_layout(global_batch: int, process_index: int, process_count: int, start_position: int) -> None:
    if global_batch < 1:
        raise ValueError(f"train.global_batch={global_batch}: must be >= 1")
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} must be in [0, process_count={process_count})")
    if global_batch % process_count:
        raise ValueError(
            f"train.global_batch={global_batch} is not divisible by process_count={process_count}: every "
            "process must read the same number of rows of each global batch"
        )
    if start_position < 0 or start_position % global_batch:
        raise ValueError(
            f"data position {start_position} is not a non-negative multiple of train.global_batch="
            f"{global_batch}: a run resumes only at a global-batch boundary"
        )


def local_positions(
    global_batch: int, process_index: int, process_count: int, start_position: int, num_batches: int
) -> np.ndarray:
    """Global positions this process reads in its next `num_batches` batches: int64 [num_batches, B/n]."""
    _check_layout(global_batch, process_index, process_count, start_position)
    local = global_batch // process_count
    g = start_position // global_batch + np.arange(num_batches, dtype=np.int64)[:, None]
    return g * global_batch + process_index * local + np.arange(local, dtype=np.int64)[None, :]


class FlatOrder:
    """(batch g, row) -> sample index for a dataset without buckets: position g*B + row in `GlobalOrder`."""

    def __init__(self, num_samples: int, seed: int, global_batch: int):
        self.order = GlobalOrder(num_samples, seed)
        self.global_batch = int(global_batch)

    def __call__(self, batch: int, row: int) -> int:
        return int(self.order(batch * self.global_batch + row))

    def bucket_of_batch(self, batch: int) -> int:
        return -1


class BucketOrder:
    """(batch g, row) -> sample index when every global batch must come from one aspect bucket.

    Bucket b holds n_b samples and contributes m_b = n_b // B batches to each cycle of T = sum(m_b) global
    batches. Cycle c = g // T visits the T slots in the order of `GlobalOrder(T, seed)` (a fresh permutation per
    cycle); slot s lies in bucket b's range [S_b, S_b + m_b), so batch g is bucket b's batch number
    r = c*m_b + (s - S_b). Row `row` of it is bucket position q = r*B + row, read through the bucket's own
    `GlobalOrder(n_b, .)`, epoch after epoch. Every step is a closed form of (g, row): any process, any
    process count and any resume point agree on the bucket of a batch and on its samples, with no state.
    Buckets with fewer than B samples are never drawn (their count is in `unused`).

    Args:
      members: per bucket, the dataset indices of its samples (int arrays).
      global_batch: B.
      seed: data seed.
    """

    def __init__(self, members: Sequence[np.ndarray], global_batch: int, seed: int):
        self.global_batch = int(global_batch)
        self.members = [np.asarray(m, np.int64) for m in members]
        self.batches = np.array([len(m) // self.global_batch for m in self.members], np.int64)
        self.unused = [b for b, m in enumerate(self.members) if 0 < len(m) < self.global_batch]
        if self.batches.sum() == 0:
            sizes = [len(m) for m in self.members]
            raise ValueError(
                f"no aspect bucket holds a full global batch of {global_batch} samples (bucket sizes {sizes}): "
                "prepare more data, fewer buckets, or lower train.global_batch"
            )
        self.ends = np.cumsum(self.batches)
        self.slots = GlobalOrder(int(self.ends[-1]), seed)
        # Each bucket's own permutation seed: GlobalOrder mixes it, so a distinct offset per bucket suffices.
        self.orders = [
            GlobalOrder(len(m), (seed + (b + 1) * _GOLDEN) & (2**64 - 1)) if len(m) else None
            for b, m in enumerate(self.members)
        ]

    def _slot(self, batch: int) -> tuple[int, int]:
        """Bucket of global batch `batch` and its batch number within the bucket."""
        cycle = batch // int(self.ends[-1])
        slot = int(self.slots(batch))
        b = int(np.searchsorted(self.ends, slot, side="right"))
        start = int(self.ends[b] - self.batches[b])
        return b, cycle * int(self.batches[b]) + slot - start

    def bucket_of_batch(self, batch: int) -> int:
        return self._slot(batch)[0]

    def __call__(self, batch: int, row: int) -> int:
        b, r = self._slot(batch)
        return int(self.members[b][self.orders[b](r * self.global_batch + row)])


@dataclasses.dataclass(frozen=True)
class Stage:
    """From global batch `start_step` on, samples come from `dataset` in `order` (batch numbers count from the
    stage's start, so each stage reads its data from its own position 0)."""

    start_step: int
    dataset: Any
    order: Callable[[int, int], int]

    def image_shape(self, batch: int) -> tuple[int, int]:
        """(H, W) of the images in the stage's batch number `batch`."""
        if isinstance(self.dataset, shards.ShardSource):
            return self.dataset.image_shape(self.order.bucket_of_batch(batch))
        return (self.dataset.image_size, self.dataset.image_size)


def _stage_entries(data_cfg: Any) -> list[tuple[int, Any]]:
    """(start_step, shard directory or image size) per stage, validated; one entry when data.stages is empty."""
    stages = tuple(data_cfg.stages)
    if not stages:
        if data_cfg.name == "shards" and not data_cfg.path:
            raise ValueError(
                "data.name='shards' needs data.path, a directory made by scripts/prepare_data.py (docs/data.md), "
                "or data.stages"
            )
        return [(0, data_cfg.path if data_cfg.name == "shards" else data_cfg.image_size)]
    entries = []
    kind = str if data_cfg.name == "shards" else int
    for entry in stages:
        if len(entry) != 2 or not isinstance(entry[0], int) or not isinstance(entry[1], kind):
            what = "a shard directory (str)" if kind is str else "an image size (int)"
            raise ValueError(
                f"data.stages entry {entry!r}: expected (start_step, {what}) for data.name={data_cfg.name!r}"
            )
        entries.append((int(entry[0]), entry[1]))
    starts = [e[0] for e in entries]
    if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
        raise ValueError(f"data.stages start steps {starts} must begin at 0 and increase")
    return entries


def heldout_compositions(data_cfg: Any) -> split.Compositions:
    """The compositions the synthetic data's training split never shows (data.heldout_frac, data.heldout_seed):
    chosen from the palette (data.colors, data.shapes) and the split's own seed alone."""
    shapes = tuple(data_cfg.get("shapes", ())) or synthetic.SHAPES
    colors = tuple(data_cfg.get("colors", ())) or synthetic.COLOR_NAMES
    frac, seed = float(data_cfg.get("heldout_frac", 0.0)), int(data_cfg.get("heldout_seed", 0))
    return split.held_out(frac, seed, colors, shapes, synthetic.GRID**2)


def _open_dataset(data_cfg: Any, what: Any, which: str = "train") -> Dataset:
    if data_cfg.name == "synthetic":
        # A config saved before data.render existed (an old checkpoint, a benchmark's run record) was rendered
        # fixed, with the default scene draws: read it that way.
        return synthetic.SyntheticShapes(
            image_size=what,
            num_samples=data_cfg.num_samples,
            seed=data_cfg.seed,
            max_objects=data_cfg.max_objects,
            min_objects=data_cfg.get("min_objects", 1),
            shapes=tuple(data_cfg.get("shapes", ())),
            colors=tuple(data_cfg.get("colors", ())),
            render=data_cfg.get("render", "fixed"),
            heldout=heldout_compositions(data_cfg),
            split=which,
            caption_drop=data_cfg.get("caption_drop", 0.0),
            shift=data_cfg.get("shift", 0.0),
        )
    return shards.ShardSource(what)


EVAL_SPLITS = ("unseen", "seen")


def eval_splits(data_cfg: Any) -> tuple[str, ...]:
    """The evaluation caption sets a run's data has: unseen and seen compositions, or only seen when the run trained
    on every composition (data.heldout_frac = 0)."""
    return EVAL_SPLITS if heldout_compositions(data_cfg) else ("seen",)


def eval_dataset(data_cfg: Any, which: str) -> Dataset:
    """The synthetic data of the first stage in evaluation split `which` ("unseen": captions with a composition the
    training never shows; "seen": training-like captions from a stream the training never reads); its samples
    0, 1, 2, ... are the evaluation captions. Shards have no such split: evaluation needs the synthetic data."""
    _check_name(data_cfg)
    if data_cfg.name != "synthetic":
        raise ValueError(f"data.name={data_cfg.name!r}: evaluation splits exist for the synthetic data only")
    if which not in EVAL_SPLITS:
        raise ValueError(f"unknown evaluation split {which!r}: choose one of {EVAL_SPLITS}")
    return _open_dataset(data_cfg, _stage_entries(data_cfg)[0][1], which)


def _check_name(data_cfg: Any) -> None:
    if data_cfg.name not in CHOICES["data.name"]:
        raise ValueError(f"unknown data.name={data_cfg.name!r}; expected one of {CHOICES['data.name']}")


def dataset_from_config(data_cfg: Any) -> Dataset:
    """The random-access source named by `data.name` (the first stage's when data.stages is set): `ds[i]` ->
    dict(image uint8 [H,W,3], caption, ...); `ds.num_samples`, `ds.caption(i)`."""
    _check_name(data_cfg)
    return _open_dataset(data_cfg, _stage_entries(data_cfg)[0][1])


def make_stages(data_cfg: Any, global_batch: int) -> tuple[Stage, ...]:
    """Every stage of `data_cfg` with its dataset and sample order for global batch size `global_batch`."""
    _check_name(data_cfg)
    out = []
    for start, what in _stage_entries(data_cfg):
        ds = _open_dataset(data_cfg, what)
        if isinstance(ds, shards.ShardSource) and ds.buckets:
            order = BucketOrder(ds.bucket_members(), global_batch, data_cfg.seed)
        else:
            order = FlatOrder(ds.num_samples, data_cfg.seed, global_batch)
        out.append(Stage(start, ds, order))
    return tuple(out)


def _stage_index(stages: Sequence[Stage], step: int) -> int:
    return bisect.bisect_right([s.start_step for s in stages], step) - 1


def batch_image_shape(stages: Sequence[Stage], step: int) -> tuple[int, int]:
    """(H, W) of the images of global batch `step` (the batch that training step `step` consumes)."""
    stage = stages[_stage_index(stages, step)]
    return stage.image_shape(step - stage.start_step)


def image_shapes(stages: Sequence[Stage]) -> list[tuple[int, int]]:
    """Every (H, W) a batch can have over all stages (each needs its own compiled train step)."""
    shapes = set()
    for stage in stages:
        ds = stage.dataset
        if isinstance(ds, shards.ShardSource) and ds.buckets:
            shapes.update(ds.buckets[b] for b, n in enumerate(stage.order.batches) if n > 0)
        else:
            shapes.add(stage.image_shape(0))
    return sorted(shapes)


def captions_of(dataset: Dataset, indices: Sequence[int] | np.ndarray) -> list[str]:
    """Captions of the samples `indices` (e.g. a batch's "index" key), in order."""
    return [dataset.caption(int(i)) for i in np.asarray(indices).reshape(-1)]


def text_inputs_of(
    dataset: Dataset, indices: Sequence[int] | np.ndarray, text_max_len: int, use_emb: bool
) -> dict[str, np.ndarray]:
    """The model's text inputs for samples `indices` (e.g. the sample-grid prompts): {"text_emb" f32 [n,L,D],
    "text_mask"} from the records when `use_emb`, else {"tokens" i32 [n,L], "text_mask"} from the built-in
    tokenizer."""
    idx = np.asarray(indices).reshape(-1)
    if not use_emb:
        tokens, mask = tokenizer.encode_batch(captions_of(dataset, idx), text_max_len)
        return {"tokens": tokens, "text_mask": mask}
    pairs = [_pad_emb(dataset[int(i)]["text_emb"], text_max_len) for i in idx]
    return {"text_emb": np.stack([p[0] for p in pairs]), "text_mask": np.stack([p[1] for p in pairs])}


def _pad_emb(emb: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """[n, D] valid-token embeddings -> (f32 [max_len, D] padded with zeros at the end, mask bool [max_len])."""
    n = min(emb.shape[0], max_len)
    out = np.zeros((max_len, emb.shape[1]), np.float32)
    out[:n] = emb[:n]
    mask = np.zeros((max_len,), bool)
    mask[:n] = True
    return out, mask


def _resolve_text(stages: Sequence[Stage], text_max_len: int, text_cfg: Any) -> bool:
    """Whether batches carry `text_emb` (True) or built-in `tokens` (False); checks the stages against the text
    config. Without `text_cfg`, embeddings are used when every stage's records carry them."""
    has_emb = [isinstance(s.dataset, shards.ShardSource) and s.dataset.encoder is not None for s in stages]
    if text_cfg is not None:
        use_emb = text_cfg.encoder == "precomputed"
    elif any(has_emb) and not all(has_emb):
        raise ValueError("some data.stages carry text embeddings and some do not: prepare them all the same way")
    else:
        use_emb = all(has_emb)
    if not use_emb:
        for s in stages:
            if isinstance(s.dataset, synthetic.SyntheticShapes):
                needed = tokenizer.num_tokens(synthetic.longest_caption(s.dataset.max_objects))
                if text_max_len < needed:
                    raise ValueError(
                        f"text.max_len={text_max_len} is shorter than the longest caption with data.max_objects="
                        f"{s.dataset.max_objects} ({needed} tokens): raise text.max_len or lower data.max_objects"
                    )
        return False
    for s, ok in zip(stages, has_emb, strict=True):
        where = getattr(s.dataset, "path", "synthetic data")
        if not ok:
            raise ValueError(
                f"text.encoder='precomputed' but {where} has no text embeddings: prepare it with --encoder "
                "(scripts/prepare_data.py) or use text.encoder='builtin'"
            )
        enc = s.dataset.encoder
        if text_cfg is not None and text_cfg.frozen_encoder and enc["name"] != text_cfg.frozen_encoder:
            raise ValueError(
                f"{where} holds {enc['name']} embeddings but text.frozen_encoder={text_cfg.frozen_encoder!r}: "
                "prepare the data with that encoder, or set text.frozen_encoder to match"
            )
        if text_cfg is not None and enc["dim"] != text_cfg.emb_dim:
            raise ValueError(
                f"{where} holds {enc['name']} embeddings of dim {enc['dim']}: set text.emb_dim={enc['dim']}"
            )
        if enc["max_len"] > text_max_len:
            raise ValueError(
                f"{where} holds up to {enc['max_len']} text tokens per caption: set text.max_len >= {enc['max_len']}"
            )
    return True


@dataclasses.dataclass(frozen=True)
class _LoadSample:
    """Grain map: local batch number -> this process's rows of that global batch (image uint8, tokens or
    text_emb, text_mask, index). A whole batch is one element, so worker threads or processes each build whole
    batches and the batches do not depend on how many there are."""

    stages: tuple[Stage, ...]
    text_max_len: int
    use_emb: bool  # emit the records' text_emb instead of built-in tokens
    local_batch: int
    first_row: int  # p * B/n
    first_batch: int  # start_position // B

    def sample(self, g: int, j: int) -> dict[str, np.ndarray]:
        """Row j of this process's slice of global batch g."""
        stage = self.stages[_stage_index(self.stages, g)]
        index = stage.order(g - stage.start_step, self.first_row + j)
        sample = stage.dataset[index]
        image = np.asarray(sample["image"], np.uint8)  # the step scales it to [-1, 1] (diffusion.to_unit)
        if self.use_emb:
            emb, mask = _pad_emb(sample["text_emb"], self.text_max_len)
            return {"image": image, "text_emb": emb, "text_mask": mask, "index": np.int64(index)}
        tokens, mask = tokenizer.encode(sample["caption"], self.text_max_len)
        return {"image": image, "tokens": tokens, "text_mask": mask, "index": np.int64(index)}

    def __call__(self, element: int) -> dict[str, np.ndarray]:
        """Local batch number `element` (from the start position on): this process's rows, stacked."""
        g = int(element) + self.first_batch
        rows = [self.sample(g, j) for j in range(self.local_batch)]
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def _absl_flags_ready() -> None:
    """Grain's worker processes read absl flags, which only `absl.app.run` parses: take the defaults otherwise."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def make_batch_iterator(
    data_cfg: Any,
    text_max_len: int,
    global_batch: int,
    process_index: int,
    process_count: int,
    start_position: int,
    text_cfg: Any = None,
    stages: tuple[Stage, ...] | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """An endless iterator of this process's batches, starting at global position `start_position`.

    Args:
      data_cfg: the `data` config (name, path, stages, image_size, seed, num_samples, max_objects,
        worker_threads, worker_processes, prefetch).
      text_max_len: tokens per caption (`text.max_len`); must fit the longest synthetic caption, and the
        shards' encoder max_len when they carry embeddings.
      global_batch: samples per step across all processes; must be divisible by `process_count`.
      process_index, process_count: this process's rank and the number of processes.
      start_position: samples already consumed; a multiple of `global_batch`.
      text_cfg: the `text` config, optional: with it, text.encoder decides tokens vs embeddings and
        text.emb_dim is checked; without it, records with embeddings give embeddings.
    Yields dicts of numpy arrays with leading dim b = global_batch // process_count: `image` uint8 [b,H,W,3]
    (pixels; the train step maps them to [-1, 1] with `diffusion.to_unit`); `tokens` i32 [b,L] or `text_emb`
    f32 [b,L,D]; `text_mask` bool [b,L]; `index` i64 [b] (the sample's index in its stage's dataset). H, W are
    data.image_size, or the bucket of that global batch (`batch_image_shape`). After k batches the global
    position is start_position + k * global_batch.
    """
    _check_layout(global_batch, process_index, process_count, start_position)
    stages = stages if stages is not None else make_stages(data_cfg, global_batch)
    local = global_batch // process_count
    load = _LoadSample(
        stages=stages,
        text_max_len=int(text_max_len),
        use_emb=_resolve_text(stages, int(text_max_len), text_cfg),
        local_batch=local,
        first_row=process_index * local,
        first_batch=start_position // global_batch,
    )
    threads, processes = int(data_cfg.worker_threads), int(data_cfg.worker_processes)
    prefetch = max(1, int(data_cfg.prefetch)) if threads > 0 else 0  # in batches
    read = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch)
    # An "infinite" index space of batches: the number of steps decides when to stop, not the dataset length.
    ds = grain.MapDataset.range(np.iinfo(np.int64).max // local).map(load).to_iter_dataset(read)
    if processes > 0:  # each process builds every processes-th batch; grain reads them back in order
        _absl_flags_ready()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=processes, per_worker_buffer_size=prefetch or 1))
    return iter(ds)

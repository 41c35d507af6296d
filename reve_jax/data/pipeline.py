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
"""

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import numpy as np

from reve_jax.data import synthetic, tokenizer

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


def dataset_from_config(data_cfg: Any) -> synthetic.SyntheticShapes:
    """The random-access source named by `data.name`: `ds[i]` -> dict(image, caption, description)."""
    if data_cfg.name == "synthetic":
        return synthetic.SyntheticShapes(
            image_size=data_cfg.image_size,
            num_samples=data_cfg.num_samples,
            seed=data_cfg.seed,
            max_objects=data_cfg.max_objects,
        )
    if data_cfg.name == "shards":
        raise ValueError("data.name='shards' is not implemented yet in reve_jax.data; use 'synthetic'")
    raise ValueError(f"unknown data.name={data_cfg.name!r}; expected 'synthetic' or 'shards'")


def captions_of(dataset: synthetic.SyntheticShapes, indices: Sequence[int] | np.ndarray) -> list[str]:
    """Captions of the samples `indices` (e.g. a batch's "index" key), in order."""
    return [dataset.caption(int(i)) for i in np.asarray(indices).reshape(-1)]


@dataclasses.dataclass(frozen=True)
class _LoadSample:
    """Grain map: local element number -> one sample dict (image f32 in [-1,1], tokens, text_mask, index)."""

    dataset: synthetic.SyntheticShapes
    order: GlobalOrder
    text_max_len: int
    global_batch: int
    local_batch: int
    first_row: int  # p * B/n
    first_batch: int  # start_position // B

    def __call__(self, element: int) -> dict[str, np.ndarray]:
        g, j = divmod(int(element), self.local_batch)
        position = (self.first_batch + g) * self.global_batch + self.first_row + j
        index = int(self.order(position))
        sample = self.dataset[index]
        tokens, mask = tokenizer.encode(sample["caption"], self.text_max_len)
        # Division (not multiplication by 2/255) keeps 0 -> -1 and 255 -> 1 exact.
        image = sample["image"].astype(np.float32) / np.float32(127.5) - np.float32(1.0)
        return {"image": image, "tokens": tokens, "text_mask": mask, "index": np.int64(index)}


def make_batch_iterator(
    data_cfg: Any,
    text_max_len: int,
    global_batch: int,
    process_index: int,
    process_count: int,
    start_position: int,
) -> Iterator[dict[str, np.ndarray]]:
    """An endless iterator of this process's batches, starting at global position `start_position`.

    Args:
      data_cfg: the `data` config (name, image_size, seed, num_samples, max_objects, worker_threads,
        prefetch).
      text_max_len: tokens per caption (`text.max_len`); must fit the longest caption the data can produce.
      global_batch: samples per step across all processes; must be divisible by `process_count`.
      process_index, process_count: this process's rank and the number of processes.
      start_position: samples already consumed; a multiple of `global_batch`.
    Yields dicts of numpy arrays with leading dim b = global_batch // process_count: `image` f32 [b,S,S,3]
    in [-1, 1], `tokens` i32 [b,L], `text_mask` bool [b,L], `index` i64 [b]. After k batches the global
    position is start_position + k * global_batch.
    """
    _check_layout(global_batch, process_index, process_count, start_position)
    dataset = dataset_from_config(data_cfg)
    needed = tokenizer.num_tokens(synthetic.longest_caption(dataset.max_objects))
    if text_max_len < needed:
        raise ValueError(
            f"text.max_len={text_max_len} is shorter than the longest caption with data.max_objects="
            f"{dataset.max_objects} ({needed} tokens): raise text.max_len or lower data.max_objects"
        )
    local = global_batch // process_count
    load = _LoadSample(
        dataset=dataset,
        order=GlobalOrder(dataset.num_samples, dataset.seed),
        text_max_len=int(text_max_len),
        global_batch=int(global_batch),
        local_batch=local,
        first_row=process_index * local,
        first_batch=start_position // global_batch,
    )
    threads = int(data_cfg.worker_threads)
    # The prefetch buffer counts samples; data.prefetch counts batches.
    prefetch = max(1, int(data_cfg.prefetch)) * local if threads > 0 else 0
    read = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch)
    # An "infinite" index space: the number of steps decides when to stop, not the dataset length.
    ds = grain.MapDataset.range(np.iinfo(np.int64).max).map(load)
    return iter(ds.to_iter_dataset(read).batch(local, drop_remainder=True))

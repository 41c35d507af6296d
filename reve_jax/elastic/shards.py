"""Which process snapshots which piece of the train state, and how pieces saved under one mesh become arrays on
another.

A *piece* is one distinct shard of one leaf: a box of the global array (a (start, stop) pair per dimension) as
the leaf's sharding lays it out. Every process computes the same layout from the sharded state alone, so no
communication decides who saves what: each piece is saved once, by one of the processes that hold it on a
device, picked round-robin over the holders so that a replicated state is spread evenly instead of landing on
process 0 (`plan`).

Restoring onto another mesh (fewer hosts, another device count): each process asks for the pieces that overlap
the boxes its own devices hold under the new sharding (`needed`) and builds its arrays from them (`assemble`);
pieces of one leaf tile the global array without overlap, so a box is complete when the overlaps cover it.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Sequence

import jax
import numpy as np

Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension; () for a scalar


@dataclasses.dataclass(frozen=True)
class Piece:
    leaf: int  # position in jax.tree.leaves(state)
    box: Box
    owner: int  # the process that snapshots it


def box_of(index: tuple, shape: tuple[int, ...]) -> Box:
    """The box of a shard index (a tuple of slices, as `devices_indices_map` gives) in an array of `shape`."""
    out = []
    for sl, n in zip(index, shape, strict=False):
        start, stop, step = sl.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {index}")
        out.append((start, stop))
    out += [(0, n) for n in shape[len(out) :]]
    return tuple(out)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in out) else out


def _process(device) -> int:
    return device.process_index


def plan(leaves: Sequence, process_of: Callable = _process) -> list[Piece]:
    """Every piece of `leaves` (arrays or ShapeDtypeStructs with a sharding) and the process that saves it:
    among the processes holding a piece on a device, the ((leaf + piece) mod holders)-th. `process_of(device)`
    is the device's process (tests emulate processes on one machine with it)."""
    out = []
    for i, leaf in enumerate(leaves):
        shape = tuple(leaf.shape)
        holders: dict[Box, set[int]] = defaultdict(set)
        for device, index in leaf.sharding.devices_indices_map(shape).items():
            holders[box_of(index, shape)].add(process_of(device))
        for j, (box, procs) in enumerate(sorted(holders.items())):
            ordered = sorted(procs)
            out.append(Piece(i, box, ordered[(i + j) % len(ordered)]))
    return out


def extract(leaves: Sequence, pieces: Sequence[Piece], process_of: Callable = _process) -> list[np.ndarray]:
    """Host copies of `pieces` (all owned by this process) from the concrete `leaves`, in order. Blocks until the
    arrays are computed."""
    out = []
    for p in pieces:
        leaf = leaves[p.leaf]
        shape = tuple(leaf.shape)
        for shard in leaf.addressable_shards:
            if process_of(shard.device) == p.owner and box_of(shard.index, shape) == p.box:
                out.append(np.asarray(shard.data))
                break
        else:
            raise ValueError(f"piece {p} is not on a device of process {p.owner}")
    return out


def target_boxes(leaf, process: int | None = None, process_of: Callable = _process) -> list[Box]:
    """The distinct boxes of abstract `leaf` (with its new sharding) held by the devices of `process` (default:
    this process's addressable devices)."""
    shape = tuple(leaf.shape)
    mapping = leaf.sharding.devices_indices_map(shape)
    if process is None:
        local = {d for d in leaf.sharding.addressable_devices}
        boxes = {box_of(ix, shape) for d, ix in mapping.items() if d in local}
    else:
        boxes = {box_of(ix, shape) for d, ix in mapping.items() if process_of(d) == process}
    return sorted(boxes)


def needed(
    pieces: Sequence[tuple[int, Box]], leaves: Sequence, process: int | None = None, process_of: Callable = _process
) -> set[int]:
    """Positions in `pieces` ((leaf, box) of a saved layout) that overlap a box this process (or `process`) holds
    under the shardings of the abstract `leaves`."""
    by_leaf: dict[int, list[Box]] = {}
    out = set()
    for k, (leaf, box) in enumerate(pieces):
        if leaf not in by_leaf:
            by_leaf[leaf] = target_boxes(leaves[leaf], process, process_of)
        if any(_intersect(box, t) is not None for t in by_leaf[leaf]):
            out.add(k)
    return out


def fill(box: Box, dtype, parts: Sequence[tuple[Box, np.ndarray]]) -> np.ndarray:
    """The array of `box` built from `parts` ((box, data) of saved pieces of the same leaf). Raises ValueError
    when the parts do not cover it."""
    out = np.empty(box_shape(box), dtype=dtype)
    covered = 0
    for pbox, data in parts:
        inter = _intersect(box, pbox)
        if inter is None:
            continue
        dst = tuple(slice(lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(inter, box, strict=True))
        src = tuple(slice(lo - p0, hi - p0) for (lo, hi), (p0, _) in zip(inter, pbox, strict=True))
        out[dst] = data.reshape(box_shape(pbox))[src]
        covered += int(np.prod(box_shape(inter), dtype=np.int64))
    if covered != int(np.prod(box_shape(box), dtype=np.int64)):
        raise ValueError(f"saved pieces cover {covered} of the {int(np.prod(box_shape(box)))} elements of {box}")
    return out


def assemble(abstract, parts: Sequence[tuple[Box, np.ndarray]]) -> jax.Array:
    """A jax.Array with the shape, dtype and sharding of `abstract` (a ShapeDtypeStruct) from saved pieces of
    that leaf; only the boxes of this process's devices are built."""
    shape = tuple(abstract.shape)
    dtype = np.dtype(abstract.dtype)
    cache: dict[Box, np.ndarray] = {}

    def block(index):
        box = box_of(index, shape)
        if box not in cache:
            cache[box] = fill(box, dtype, parts)
        return cache[box]

    return jax.make_array_from_callback(shape, abstract.sharding, block)

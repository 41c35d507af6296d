"""Data preparation into shards and reading them back: round trip, bad input, resume, WebDataset, aspect buckets,
resolution stages, and a few training steps on shards with frozen MiniLM embeddings."""

import importlib.util
import io
import json
import pathlib
import tarfile

import numpy as np
import pytest
from PIL import Image
from util import load_script, tiny_config

from reve_jax import config
from reve_jax.data import buckets, pipeline, prepare, shards, tokenizer
from reve_jax.text_encoders.minilm import MiniLMEncoder
from reve_jax.train import sampling, trainer

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORDS = ("red", "green", "blue", "circle", "square", "small", "large", "top", "left", "center")
BROKEN = {
    "truncated.jpg": "unreadable image",
    "random.png": "unreadable image",
    "tiny.png": "too small",
    "sub/nocaption.png": "missing caption",
}


def _data_cfg(**overrides):
    """The base config's `data` section with test overrides (so tests follow its keys)."""
    spec = importlib.util.spec_from_file_location("_base_config", ROOT / "configs" / "base.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.get_config().data
    cfg.update({"name": "shards", "image_size": 16, "worker_threads": 1, "prefetch": 1, **overrides})
    return cfg


def _take(it, n):
    return [next(it) for _ in range(n)]


def _concat(parts):
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _assert_batches_equal(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def _smooth(h, w, seed):
    """A smooth RGB gradient (so resampling errors stay small), uint8 [h, w, 3]."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    chans = [rng.uniform(40, 200) + rng.uniform(-50, 50) * x + rng.uniform(-50, 50) * y for _ in range(3)]
    return np.clip(np.stack(chans, -1), 0, 255).astype(np.uint8)


def _caption(i):
    return f"a {WORDS[i % 3]} {WORDS[3 + i % 2]} at the {WORDS[7 + i % 3]}"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A folder of good and broken images. Returns (root, {relative path: (caption, pixels or None)})."""
    root = tmp_path_factory.mktemp("photos")
    (root / "sub").mkdir()
    expect = {}
    rng = np.random.default_rng(0)
    for i in range(6):  # already 16x16: pixels must come back exactly
        name = f"sub/exact{i}.png" if i % 2 else f"exact{i}.png"
        pixels = rng.integers(0, 256, (16, 16, 3), np.uint8)
        Image.fromarray(pixels).save(root / name)
        (root / name).with_suffix(".txt").write_text(_caption(i) + "\n")
        expect[name] = (_caption(i), pixels)
    jsonl = []
    for i, (h, w) in enumerate([(30, 40), (36, 20), (33, 33)]):  # JPEGs, cropped and resized
        name = f"photo{i}.jpg"
        Image.fromarray(_smooth(h, w, i)).save(root / name, quality=95)
        jsonl.append(json.dumps({"file": name, "caption": _caption(10 + i)}))
        expect[name] = (_caption(10 + i), None)
    jsonl.append("{not json")  # a broken line costs only itself
    (root / "captions.jsonl").write_text("\n".join(jsonl) + "\n")
    rgba = np.zeros((16, 16, 4), np.uint8)
    rgba[..., 0], rgba[:8, :, 3] = 200, 255  # bottom half transparent: composited on white
    Image.fromarray(rgba).save(root / "alpha.png")
    (root / "alpha.txt").write_text(_caption(20))
    want = np.full((16, 16, 3), 255, np.uint8)
    want[:8] = (200, 0, 0)
    expect["alpha.png"] = (_caption(20), want)
    good = (root / "photo0.jpg").read_bytes()
    (root / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (root / "random.png").write_bytes(rng.integers(0, 256, 300, np.uint8).tobytes())
    Image.fromarray(rng.integers(0, 256, (4, 4, 3), np.uint8)).save(root / "tiny.png")
    Image.fromarray(rng.integers(0, 256, (16, 16, 3), np.uint8)).save(root / "sub/nocaption.png")
    for name in ("truncated.jpg", "random.png", "tiny.png"):
        (root / name).with_suffix(".txt").write_text("a broken one")
    return root, expect


@pytest.fixture(scope="module")
def minilm():
    from reve_jax.text_encoders.minilm import MiniLMEncoder

    return MiniLMEncoder(max_len=16, batch_size=8)


def test_folder_round_trip_skips_bad_input_and_reads_back_through_the_pipeline(folder, tmp_path):
    root, expect = folder
    out = tmp_path / "shards"
    spec = prepare.ImageSpec(16)
    manifest = prepare.prepare(prepare.FolderSource(root, shard_size=4), out, spec, workers=2, progress=False)

    assert manifest["count"] == len(expect) and manifest["num_inputs"] == len(expect) + len(BROKEN)
    assert {s["source"]: prepare._reason_kind(s["reason"]) for s in manifest["skipped"]} == BROKEN
    assert manifest["skip_reasons"] == {"unreadable image": 2, "too small": 1, "missing caption": 1}
    text = prepare.summary_text(manifest)
    assert all(name in text for name in BROKEN)
    assert json.loads((out / shards.MANIFEST).read_text()) == manifest

    src = shards.ShardSource(out)
    by_key = {src[i]["key"]: src[i] for i in range(len(src))}
    assert set(by_key) == set(expect)
    for name, (caption, pixels) in expect.items():
        rec = by_key[name]
        assert rec["caption"] == caption and rec["image"].shape == (16, 16, 3) and "text_emb" not in rec
        if pixels is not None:
            np.testing.assert_array_equal(rec["image"], pixels)
        else:  # center crop + resize of a smooth image: close to a plain numpy crop of the original
            with Image.open(root / name) as im:
                orig = np.asarray(im.convert("RGB"), np.float32)
            h, w = orig.shape[:2]
            s = min(h, w)
            crop = orig[(h - s) // 2 : (h - s) // 2 + s, (w - s) // 2 : (w - s) // 2 + s]
            ref = np.asarray(Image.fromarray(crop.astype(np.uint8)).resize((16, 16), Image.Resampling.BOX))
            assert np.abs(rec["image"].astype(np.float32) - ref).mean() < 4.0
            assert rec["orig_size"] == [h, w]

    cfg = _data_cfg(path=str(out), prefetch=2)
    epoch = _take(pipeline.make_batch_iterator(cfg, 16, 5, 0, 1, 0), 2)
    assert sorted(np.concatenate([b["index"] for b in epoch]).tolist()) == list(range(len(src)))
    for b in epoch:
        assert set(b) == {"image", "tokens", "text_mask", "index"}
        for row, i in enumerate(b["index"]):
            rec = src[int(i)]
            np.testing.assert_array_equal(b["image"][row], rec["image"])
            assert tokenizer.decode(b["tokens"][row], b["text_mask"][row]) == rec["caption"]
        assert pipeline.captions_of(src, b["index"]) == [src[int(i)]["caption"] for i in b["index"]]
    parts = [_take(pipeline.make_batch_iterator(cfg, 16, 10, p, 2, 10), 2) for p in range(2)]
    whole = _take(pipeline.make_batch_iterator(cfg, 16, 10, 0, 1, 10), 2)
    _assert_batches_equal(whole, [_concat(pair) for pair in zip(*parts, strict=True)])
    # The shard readers travel to Grain worker processes, and the batches stay the same.
    it = pipeline.make_batch_iterator(_data_cfg(path=str(out), worker_processes=2), 16, 10, 0, 1, 10)
    try:
        _assert_batches_equal(whole, _take(it, 2))
    finally:
        it.close()


def test_interrupted_preparation_resumes_without_redoing_shards(folder, tmp_path, monkeypatch, minilm):
    root, _ = folder
    spec = prepare.ImageSpec(16, image_format="png")

    def run(out):
        source = prepare.FolderSource(root, shard_size=3)
        return prepare.prepare(source, out, spec, encoder=minilm, encode_batch=8, workers=0, progress=False)

    fresh = run(tmp_path / "fresh")
    assert fresh["encoder"] == {"name": "minilm", "dim": 384, "max_len": 16, "dtype": "float32"}
    n_shards = len(fresh["shards"])

    real_commit = prepare._commit_shard
    written = []

    def crash_in_third(out, unit, records, info):
        if len(written) == 2:  # die half-way through writing the third shard
            tmp = out / (shards.shard_name(unit) + ".tmp")
            tmp.write_bytes(b"half a shard")
            raise KeyboardInterrupt
        written.append(unit)
        real_commit(out, unit, records, info)

    monkeypatch.setattr(prepare, "_commit_shard", crash_in_third)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "resumed")
    assert written == [0, 1] and not (tmp_path / "resumed" / shards.MANIFEST).exists()
    with pytest.raises(FileNotFoundError, match="rerun the same"):
        shards.ShardSource(tmp_path / "resumed")

    redone = []
    spy = lambda out, unit, *a: (redone.append(unit), real_commit(out, unit, *a))  # noqa: E731
    monkeypatch.setattr(prepare, "_commit_shard", spy)
    resumed = run(tmp_path / "resumed")
    assert redone == list(range(2, n_shards))
    assert resumed == fresh
    files = sorted(p.name for p in (tmp_path / "fresh").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "resumed").iterdir())
    for name in files:
        assert (tmp_path / "fresh" / name).read_bytes() == (tmp_path / "resumed" / name).read_bytes(), name

    # A rerun with other settings is refused instead of mixing two kinds of shards.
    with pytest.raises(ValueError, match="different settings"):
        prepare.prepare(prepare.FolderSource(root, 3), tmp_path / "resumed", prepare.ImageSpec(32), workers=0)

    src = shards.ShardSource(tmp_path / "resumed")
    rec = src[0]
    ref = minilm.encode([rec["caption"]])
    n = int(ref.mask[0].sum())
    assert rec["text_emb"].shape == (n, 384)
    np.testing.assert_allclose(rec["text_emb"], ref.emb[0, :n], rtol=0, atol=1e-5)
    (b,) = _take(pipeline.make_batch_iterator(_data_cfg(path=str(tmp_path / "resumed")), 20, 2, 0, 1, 0), 1)
    assert set(b) == {"image", "text_emb", "text_mask", "index"} and b["text_emb"].shape == (2, 20, 384)
    for row, i in enumerate(b["index"]):
        emb = src[int(i)]["text_emb"]
        np.testing.assert_array_equal(b["text_emb"][row, : len(emb)], emb)
        assert b["text_mask"][row].sum() == len(emb) and b["text_mask"][row, : len(emb)].all()
        assert not b["text_emb"][row, len(emb) :].any()


def _tar(path, members):
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _png(pixels):
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def test_webdataset_tars_with_a_damaged_one(tmp_path):
    px = [np.random.default_rng(i).integers(0, 256, (16, 16, 3), np.uint8) for i in range(4)]
    _tar(
        tmp_path / "a.tar",
        [
            ("d/s0.png", _png(px[0])), ("d/s0.txt", b"first"),
            ("d/s1.png", _png(px[1])), ("d/s1.json", json.dumps({"caption": "second"}).encode()),
            ("d/s2.txt", b"no image here"),
            ("d/s3.png", b"garbage"), ("d/s3.txt", b"bad"),
        ],
    )  # fmt: skip
    b_members = [("s4.png", _png(px[2])), ("s4.txt", b"third"), ("s5.txt", b"cut"), ("s5.png", _png(px[3]))]
    _tar(tmp_path / "b.tar", b_members)
    with tarfile.open(tmp_path / "b.tar") as tar:
        cut = tar.getmember("s5.png").offset_data + 50
    data = (tmp_path / "b.tar").read_bytes()
    (tmp_path / "b.tar").write_bytes(data[:cut])  # a download that stopped inside the last image
    src = prepare.WebDatasetSource([tmp_path / "a.tar", tmp_path / "b.tar"])
    manifest = prepare.prepare(src, tmp_path / "out", prepare.ImageSpec(16), workers=0, progress=False)
    reasons = {s["source"]: prepare._reason_kind(s["reason"]) for s in manifest["skipped"]}
    assert reasons == {
        "a.tar:d/s2": "no image file in sample",
        "a.tar:d/s3": "unreadable image",
        "b.tar:s5": "no image file in sample",
        "b.tar:<rest>": "unreadable tar",
    }
    ds = shards.ShardSource(tmp_path / "out")
    got = {ds[i]["key"]: ds[i] for i in range(len(ds))}
    assert sorted(got) == ["a.tar:d/s0", "a.tar:d/s1", "b.tar:s4"]
    expected = [("a.tar:d/s0", "first", px[0]), ("a.tar:d/s1", "second", px[1]), ("b.tar:s4", "third", px[2])]
    for key, caption, pixels in expected:
        assert got[key]["caption"] == caption
        np.testing.assert_array_equal(got[key]["image"], pixels)


def _bucket_folder(root, n_per_shape=8):
    root.mkdir()
    shapes = {"wide": (20, 40), "tall": (40, 20), "square": (24, 24)}
    for kind, (h, w) in shapes.items():
        for i in range(n_per_shape):
            name = root / f"{kind}{i}.png"
            Image.fromarray(_smooth(h, w, i)).save(name)
            name.with_suffix(".txt").write_text(f"a {kind} one")
    return root


def test_aspect_buckets_and_resolution_stages(tmp_path):
    src = _bucket_folder(tmp_path / "photos")
    table = buckets.make_buckets(16, 4)
    assert table == ((12, 20), (16, 16), (20, 12))
    assert all(h % 4 == 0 and w % 4 == 0 and buckets.num_tokens((h, w), 4) <= 16 for h, w in table)
    spec = prepare.ImageSpec(16, buckets=table, image_format="png")
    manifest = prepare.prepare(prepare.FolderSource(src, 5), tmp_path / "b", spec, workers=0, progress=False)
    assert manifest["bucket_counts"] == [8, 8, 8] and manifest["count"] == 24
    ds = shards.ShardSource(tmp_path / "b")
    for i in range(len(ds)):
        rec = ds[i]
        want = {"wide": (12, 20), "tall": (20, 12), "square": (16, 16)}[rec["caption"].split()[1]]
        assert rec["image"].shape == (*want, 3) and table[rec["bucket"]] == want

    B = 4  # each bucket gives 2 batches per cycle of 6
    cfg = _data_cfg(path=str(tmp_path / "b"))
    stages = pipeline.make_stages(cfg, B)
    whole = _take(pipeline.make_batch_iterator(cfg, 16, B, 0, 1, 0), 12)
    for g, b in enumerate(whole):
        assert b["image"].shape[1:3] == pipeline.batch_image_shape(stages, g)
        assert {ds[int(i)]["bucket"] for i in b["index"]} == {table.index(b["image"].shape[1:3])}
    for cycle in (whole[:6], whole[6:]):  # a cycle reads every record exactly once
        assert sorted(np.concatenate([b["index"] for b in cycle]).tolist()) == list(range(24))
    assert sorted(b["image"].shape[1:3] for b in whole[:6]) == sorted(table * 2)
    assert pipeline.image_shapes(stages) == sorted(table)
    parts = [_take(pipeline.make_batch_iterator(cfg, 16, B, p, 2, 3 * B), 4) for p in range(2)]
    _assert_batches_equal(whole[3:7], [_concat(pair) for pair in zip(*parts, strict=True)])

    # Stages: 16 px square shards for 3 steps, then the bucketed shards from their own position 0.
    flat = prepare.prepare(prepare.FolderSource(src, 5), tmp_path / "f", prepare.ImageSpec(16), workers=0)
    assert flat["count"] == 24
    staged = _data_cfg(stages=((0, str(tmp_path / "f")), (3, str(tmp_path / "b"))))
    got = _take(pipeline.make_batch_iterator(staged, 16, B, 0, 1, 0), 6)
    assert [b["image"].shape[1:3] for b in got[:3]] == [(16, 16)] * 3
    _assert_batches_equal(got[3:], whole[:3])
    _assert_batches_equal(_take(pipeline.make_batch_iterator(staged, 16, B, 0, 1, 4 * B), 2), got[4:])
    synth = _data_cfg(name="synthetic", num_samples=16, max_objects=1, stages=((0, 12), (2, 16)))
    assert [b["image"].shape[1:3] for b in _take(pipeline.make_batch_iterator(synth, 16, B, 0, 1, 0), 3)] == [
        (12, 12), (12, 12), (16, 16),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="begin at 0"):
        pipeline.make_stages(_data_cfg(stages=((5, str(tmp_path / "f")),)), B)

    # The trainer compiles one step per shape: 16 px squares for 3 steps, then every aspect bucket.
    run_cfg = tiny_config(
        "data.name='shards'", f"data.stages=((0, '{tmp_path / 'f'}'), (3, '{tmp_path / 'b'}'))",
        "train.steps=6", "train.log_every=1", "train.ckpt_every=3",
    )  # fmt: skip
    summary = trainer.run(run_cfg, tmp_path / "run")
    assert summary["reason"] == "finished" and summary["step"] == 6
    assert sorted(map(tuple, summary["compiled_shapes"])) == sorted(table)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(np.isfinite(r["loss"]) for r in rows)
    with pytest.raises(ValueError, match="no aspect bucket holds a full global batch"):
        pipeline.make_stages(cfg, 16)


def test_train_steps_on_synthetic_shards_with_minilm_embeddings(tmp_path):
    script = load_script("prepare_data")
    out = tmp_path / "synth"
    argv = ["synthetic", "--num", "24", "--image-size", "16", "--max-objects", "1", "--out", str(out)]
    manifest = script.main(argv + ["--encoder", "minilm", "--max-len", "16", "--encode-batch", "8", "--workers", "0"])
    assert manifest["count"] == 24 and manifest["encoder"]["dim"] == 384

    cfg_items = ("data.name='shards'", f"data.path='{out}'", "text.encoder='precomputed'", "text.emb_dim=384",
                 "train.steps=2")  # fmt: skip
    cfg = tiny_config(*cfg_items)
    summary = trainer.run(cfg, tmp_path / "run")
    assert summary["reason"] == "finished" and summary["step"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(np.isfinite(r["loss"]) for r in rows)
    # The run records the encoder that made its embeddings, so sample.py encodes new prompts the same way.
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["text"]["frozen_encoder"] == "minilm"
    prompts = ["a small red circle in the center, on a white background", "a large blue square at the top left"]
    load_script("sample").main(["--workdir", str(tmp_path / "run"), *(a for p in prompts for a in ("--prompt", p))])
    assert (tmp_path / "run" / "samples" / "cli.png").stat().st_size > 0
    inputs = sampling.prompt_inputs(config.from_json(json.dumps(saved)), prompts)
    reference = MiniLMEncoder(max_len=16).encode(prompts)
    np.testing.assert_allclose(inputs["text_emb"], reference.emb, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(inputs["text_mask"], reference.mask)
    with pytest.raises(ValueError, match="holds minilm embeddings but text.frozen_encoder='t5'"):
        trainer.run(tiny_config(*(o for o in cfg_items), "text.frozen_encoder='t5'"), tmp_path / "run_t5")
    with pytest.raises(ValueError, match="text.emb_dim=384"):
        other = tiny_config("text.encoder='precomputed'", "text.emb_dim=512").text
        pipeline.make_batch_iterator(cfg.data, 16, 8, 0, 1, 0, text_cfg=other)
    with pytest.raises(ValueError, match="text.max_len >= 16"):
        pipeline.make_batch_iterator(cfg.data, 8, 8, 0, 1, 0)

"""Converting a workdir between the per-block and the stacked (scan) layouts: the converted state is the old one
leaf for leaf, training resumes there and ends where an unconverted run ends, a round trip is bit-exact, and
conversions that would change the weights are refused without writing anything."""

import jax
import numpy as np
import pytest
from util import load_script, tiny_config

from reve_jax import convert, sharding
from reve_jax.checkpoint import Checkpointer
from reve_jax.model import dit
from reve_jax.train import train_state, trainer

MUON = ("optim.name='muon'", "ema.decays=(0.9, 0.99)", "model.depth=3")
SCAN = "model.scan_layers=True"


def _latest(workdir, cfg):
    setup = train_state.make_setup(cfg, sharding.make_mesh(cfg.mesh))
    reader = Checkpointer(workdir)
    try:
        state, meta = reader.restore_latest(setup.abstract_state)
    finally:
        reader.close()
    return jax.device_get(state), meta


def _assert_close(a, b, **tol):
    fa, fb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)
    assert len(fa) == len(fb)
    for (path, x), y in zip(fa, fb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path), **tol)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An unrolled Muon run stopped at step 5 (`half`), the same run straight to step 7 (`straight`), and `half`
    converted to the scan layout (`scan`). (The zero-initialised output and gates keep the blocks' weights and
    momentum at zero for the first steps: by step 5 every block has its own.)"""
    root = tmp_path_factory.mktemp("convert")
    trainer.run(tiny_config(*MUON, "train.steps=5"), root / "half")
    trainer.run(tiny_config(*MUON, "train.steps=7"), root / "straight")
    summary = convert.convert_workdir(root / "half", root / "scan", [f"--config.{SCAN}"])
    assert summary["step"] == 5 and summary["changed"] == {"model.scan_layers": (False, True)}
    return root


def test_converted_state_is_the_old_one_stacked(runs):
    old, old_meta = _latest(runs / "half", tiny_config(*MUON))
    new, new_meta = _latest(runs / "scan", tiny_config(*MUON, SCAN))
    assert new_meta["step"] == old_meta["step"] == 5
    assert new_meta["data_position"] == old_meta["data_position"] == 5 * 8
    assert new["params"]["blocks"]["attn"]["q"]["kernel"].shape[0] == 3
    _assert_close(new["params"], dit.stack_blocks(old["params"]), rtol=0, atol=0)
    for k in old["ema"]:
        _assert_close(new["ema"][k], dit.stack_blocks(old["ema"][k]), rtol=0, atol=0)
    np.testing.assert_array_equal(new["rng"], old["rng"])


def test_training_resumes_in_the_converted_workdir_and_ends_where_the_unconverted_run_ends(runs):
    half, _ = _latest(runs / "half", tiny_config(*MUON))
    momentum = [  # the Muon momentum of each block's query kernel
        np.asarray(x)
        for path, x in jax.tree_util.tree_flatten_with_path(half["opt_state"])[0]
        if "'muon'" in jax.tree_util.keystr(path) and jax.tree_util.keystr(path).endswith("['attn']['q']['kernel']")
    ]
    assert len(momentum) == 3
    assert all(np.abs(m).max() > 0 for m in momentum) and not np.allclose(momentum[0], momentum[2])
    summary = trainer.run(tiny_config(*MUON, SCAN, "train.steps=7"), runs / "scan")
    assert summary["start_step"] == 5 and summary["step"] == 7
    straight, _ = _latest(runs / "straight", tiny_config(*MUON))
    resumed, meta = _latest(runs / "scan", tiny_config(*MUON, SCAN))
    assert meta["data_position"] == 7 * 8
    # Optimizer moments in the wrong place (another block's momentum) would move the weights apart.
    _assert_close(dit.unstack_blocks(resumed["params"]), straight["params"], rtol=1e-5, atol=1e-6)


def test_round_trip_is_bit_exact_and_the_source_is_untouched(runs, tmp_path):
    before = sorted(p.name for p in (runs / "half" / "checkpoints").iterdir())
    convert.convert_workdir(runs / "half", tmp_path / "scan", [SCAN])
    convert.convert_workdir(tmp_path / "scan", tmp_path / "back", ["model.scan_layers=False"])
    a, _ = _latest(runs / "half", tiny_config(*MUON))
    b, _ = _latest(tmp_path / "back", tiny_config(*MUON))
    _assert_close(b, jax.tree.leaves(a), rtol=0, atol=0)
    assert sorted(p.name for p in (runs / "half" / "checkpoints").iterdir()) == before


def test_conversions_that_change_the_weights_are_refused_and_write_nothing(runs, tmp_path):
    with pytest.raises(convert.ConversionError, match="model.width: 32 -> 64"):
        convert.convert_workdir(runs / "half", tmp_path / "wide", [SCAN, "model.width=64"])
    assert not (tmp_path / "wide").exists()
    # A Muon pattern that selects fewer weights leaves momentum buffers without a place.
    narrow = "optim.muon_patterns=('blocks/([0-9]+/)?attn/(q|k|v|out)/kernel',)"
    with pytest.raises(convert.ConversionError, match="must select the same weights"):
        convert.convert_workdir(runs / "half", tmp_path / "narrow", [narrow])
    with pytest.raises(convert.ConversionError, match="already holds checkpoints"):
        convert.convert_workdir(runs / "half", runs / "straight", [SCAN])


def test_script_reports_errors_as_one_line(runs, tmp_path, capsys):
    script = load_script("convert_checkpoint")
    with pytest.raises(SystemExit, match="conversion error: .*has no checkpoints"):
        script.main(["--workdir", str(tmp_path / "nothing"), "--out", str(tmp_path / "out"), f"--config.{SCAN}"])
    with pytest.raises(SystemExit) as e:
        script.main(["--workdir", str(runs / "half"), "--out", str(tmp_path / "out"), "--scan"])
    assert e.value.code == 2 and "unrecognised arguments ['--scan']" in capsys.readouterr().err
    summary = script.main(["--workdir", str(runs / "half"), "--out", str(tmp_path / "out"), f"--config.{SCAN}"])
    assert summary["changed"] == {"model.scan_layers": (False, True)}

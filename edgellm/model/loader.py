"""Open a GGUF model: validate the header (gguf_file), build the config (config), map the data.

Nothing large is allocated here: tensor data stay memory-mapped until a backend's prepare().
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..errors import ModelFormatError, ModelNotFoundError
from .config import ModelConfig, config_from_gguf
from .gguf_file import GGUFFile, read_gguf, release_strings, tensor_view
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelFile:
    path: str
    gguf: GGUFFile
    config: ModelConfig
    tokenizer: Tokenizer

    def raw(self, name: str) -> np.ndarray:
        """Zero-copy view of a tensor's bytes (F32/F16 as floats, block types as uint8)."""
        return tensor_view(self.gguf, self.gguf.tensors[name])

    def tensor_type(self, name: str):
        return self.gguf.tensors[name].ggml_type

    @property
    def metadata(self) -> dict:
        return self.gguf.metadata

    @property
    def file_size(self) -> int:
        return self.gguf.file_size

    @cached_property
    def tensor_type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.gguf.tensors.values():
            counts[t.ggml_type.name] = counts.get(t.ggml_type.name, 0) + 1
        return counts


def open_model(path: str | os.PathLike) -> ModelFile:
    """Validate and open: header walk, hyperparameters against tensors, tokenizer metadata.
    Raises ModelFormatError/UnsupportedModelError naming file and field; nothing large is
    allocated (tensor data stay mapped)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"{path}: no such model file")
    g = read_gguf(path)
    cfg = config_from_gguf(path, g.metadata, g.tensors)
    tok = Tokenizer.from_metadata(g.metadata, path)
    if tok.vocab_size != cfg.vocab_size:
        raise ModelFormatError(path, "tokenizer.ggml.tokens",
                               f"{tok.vocab_size} tokens disagree with the embedding's {cfg.vocab_size} rows")
    # the merges are read once, by the tokenizer just built (the native BPE keeps its own copy):
    # held decoded they were ~0.9 MiB resident for SmolLM2 for nothing. A later reader (requant
    # copies every key) gets them re-read from the file, checked to be the bytes parsed.
    release_strings(g, "tokenizer.ggml.merges")
    return ModelFile(path=path, gguf=g, config=cfg, tokenizer=tok)

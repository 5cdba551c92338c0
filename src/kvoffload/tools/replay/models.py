"""KV bytes per token of a model, from a Hugging Face ``config.json`` or a named preset, and capacity strings.

Per token a decoder layer holds one key and one value vector per KV head: ``2 * layers * kv_heads * head_dim *
dtype_bytes``. MLA models (DeepSeek V2/V3) hold one compressed latent and one rotary key per layer instead:
``layers * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, NamedTuple

GIB = 1 << 30


class ModelError(ValueError):
    """A model that is neither a known preset nor a readable config.json, or a config without the fields needed."""


class KVShape(NamedTuple):
    """What decides a model's KV bytes per token."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    mla_dim: int = 0
    """``kv_lora_rank + qk_rope_head_dim`` for MLA models (then ``kv_heads`` and ``head_dim`` are unused), else 0."""

    @property
    def bytes_per_token(self) -> int:
        if self.mla_dim:
            return self.layers * self.mla_dim * self.dtype_bytes
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


PRESETS: dict[str, KVShape] = {
    # Published shapes (the models' config.json files), bf16 KV.
    "llama-3.2-1b": KVShape(layers=16, kv_heads=8, head_dim=64, dtype_bytes=2),
    "llama-3.1-8b": KVShape(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2),
    "llama-3.1-70b": KVShape(layers=80, kv_heads=8, head_dim=128, dtype_bytes=2),
    "llama-3.1-405b": KVShape(layers=126, kv_heads=8, head_dim=128, dtype_bytes=2),
    "mistral-7b": KVShape(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2),
    "qwen2.5-7b": KVShape(layers=28, kv_heads=4, head_dim=128, dtype_bytes=2),
    "qwen2.5-72b": KVShape(layers=80, kv_heads=8, head_dim=128, dtype_bytes=2),
    "deepseek-v3": KVShape(layers=61, kv_heads=1, head_dim=512 + 64, dtype_bytes=2, mla_dim=512 + 64),
}

_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float8_e4m3fn": 1,
                "float8_e5m2": 1, "fp8": 1}


def kv_shape(model: str) -> KVShape:
    """The KV shape of a preset name or of a ``config.json`` path (a directory holding one works too).

    Raises:
        ModelError: neither a preset nor a readable config with the fields above (the message names what is missing).
    """
    preset = PRESETS.get(model.lower())
    if preset is not None:
        return preset
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read model config {path}: {e}") from None
    if not isinstance(doc, dict):
        raise ModelError(f"model config {path} is not a JSON object")
    return shape_of_config(doc, str(path))


def shape_of_config(doc: dict[str, Any], name: str = "config") -> KVShape:
    """The KV shape a Hugging Face config describes (its ``text_config`` for multimodal models).

    Raises:
        ModelError: a needed field is missing or not a positive integer.
    """
    if "num_hidden_layers" not in doc and isinstance(doc.get("text_config"), dict):
        doc = doc["text_config"]
    dtype_name = str(doc.get("torch_dtype") or doc.get("dtype") or "bfloat16").removeprefix("torch.")
    dtype_bytes = _DTYPE_BYTES.get(dtype_name)
    if dtype_bytes is None:
        raise ModelError(f"{name}: unknown torch_dtype {dtype_name!r}; known: {', '.join(_DTYPE_BYTES)}")
    layers = _field(doc, name, "num_hidden_layers")
    if "kv_lora_rank" in doc:
        mla = _field(doc, name, "kv_lora_rank") + _field(doc, name, "qk_rope_head_dim")
        return KVShape(layers, 1, mla, dtype_bytes, mla_dim=mla)
    heads = _field(doc, name, "num_attention_heads")
    kv_heads = _field(doc, name, "num_key_value_heads") if doc.get("num_key_value_heads") is not None else heads
    head_dim = (_field(doc, name, "head_dim") if doc.get("head_dim") is not None
                else _field(doc, name, "hidden_size") // heads)
    return KVShape(layers, kv_heads, head_dim, dtype_bytes)


def _field(doc: dict[str, Any], name: str, key: str) -> int:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelError(f"{name}: {key} must be a positive integer, got {value!r}")
    return value


_CAPACITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_TOKEN_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SCALE = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_capacity(text: str, bytes_per_token: int | None) -> int:
    """A capacity in tokens from ``3000000``, ``3M``, ``500k`` (tokens) or ``24GiB``, ``512MiB``, ``100GB`` (bytes of
    KV; GiB and MiB are binary, GB and MB decimal).

    Raises:
        ValueError: the text is neither, is not positive, or gives bytes without ``bytes_per_token``.
    """
    match = _CAPACITY.match(text)
    if match is None:
        raise ValueError(f"capacity {text!r}: expected tokens (3000000, 3M, 500k) or bytes (24GiB, 512MiB)")
    number, scale, unit = float(match.group(1)), match.group(2).lower(), match.group(3)
    if unit:
        if not scale:
            raise ValueError(f"capacity {text!r}: give bytes as KiB, MiB, GiB or TiB")
        if bytes_per_token is None:
            raise ValueError(f"capacity {text!r} is in bytes: give --model to convert it to tokens")
        factor = _BINARY_SCALE[scale] if unit.lower() == "ib" else _TOKEN_SCALE[scale]
        tokens = int(number * factor // bytes_per_token)
    else:
        tokens = int(number * _TOKEN_SCALE[scale])
    if tokens <= 0:
        raise ValueError(f"capacity {text!r} is less than one token")
    return tokens

"""Tiny real-weight model checkpoints that vLLM loads offline, for the demo and the end-to-end tests.

No model can be downloaded here, so the demo and tests/e2e build one: a Hugging Face checkpoint (``config.json``
and seeded random weights in ``model.safetensors``, written by transformers' ``save_pretrained``) that vLLM loads
with its normal loader, and a byte-level BPE tokenizer trained locally on a generated text. The tokenizer's
vocabulary is exactly ``vocab_size`` ids, so every id the model samples decodes.

Why real weights: vLLM's dummy load format gives flat logits, and on the CPU backend vLLM packs the linear
layers at load time and empties their parameters, so weights re-seeded after a dummy load change nothing: the
outputs then never depend on the KV cache, and no comparison of outputs could catch a wrong load. With these
weights, changing one prompt token moves the logprobs by tenths (the e2e tests check that as their control).

Families (``ModelFamily``): Llama (one full-attention KV-cache group), Gemma3 (sliding-window and full-attention
layers: several groups, vLLM's null block in the window groups), LFM2 (ShortConv state layers beside attention),
DeepSeek-V2 (MLA: one latent vector per token and layer; vLLM's CPU MLA kernel takes only a 576-wide latent).
This module imports no vLLM: it only writes files (transformers builds the weights' names and shapes).
"""

from __future__ import annotations

import enum
import json
import math
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN)
# Byte-level BPE needs the 256 byte symbols plus the special tokens before its first merge.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
# A plain chat template so `LLM.chat` and `apply_chat_template` work on the tiny model.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
WEIGHTS_FILE = "model.safetensors"


class ModelFamily(enum.Enum):
    LLAMA = "llama"
    """LlamaForCausalLM: every layer full attention."""
    GEMMA3 = "gemma3"
    """Gemma3ForCausalLM (``gemma3_text``): sliding-window layers with one full-attention layer in four."""
    LFM2 = "lfm2"
    """Lfm2ForCausalLM: ShortConv state layers alternating with full attention."""
    DEEPSEEK_V2 = "deepseek_v2"
    """DeepseekV2ForCausalLM: multi-head latent attention (MLA), dense MLPs (no experts)."""


@dataclass(frozen=True)
class TinyShape:
    """Sizes of a tiny model; the defaults are the smallest vLLM's CPU backend runs well.

    ``sliding_window`` (tokens) applies to Gemma3's window layers; ``conv_kernel`` to LFM2's ShortConv layers;
    the ``kv_lora_rank``, ``qk_*`` and ``v_head_dim`` sizes to DeepSeek-V2's latent attention (the latent is
    ``kv_lora_rank + qk_rope_head_dim`` wide: 576, the only width vLLM's CPU MLA kernel compiles for).
    """

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    vocab_size: int = 1024
    max_position: int = 4096
    intermediate_size: int = 512
    sliding_window: int = 64
    conv_kernel: int = 3
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32

    def validate(self) -> None:
        """Raises ValueError naming the first size that vLLM could not build a model from."""
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size must be at least {MIN_VOCAB_SIZE} (bytes + specials), got {self.vocab_size}"
            )


def write_tiny_model(directory: Path, family: ModelFamily = ModelFamily.LLAMA, shape: TinyShape | None = None,
                     *, seed: int = 0) -> Path:
    """Write a loadable tiny checkpoint (config, seeded random weights, tokenizer) into ``directory``.

    Args:
        directory: created if missing; existing files of the same names are overwritten.
        family: the architecture.
        shape: model sizes (default ``TinyShape()``).
        seed: the weights' seed; the same arguments give byte-identical files.

    Returns:
        ``directory``, to pass as vLLM's ``model`` (the default load format reads the safetensors).

    Raises:
        ValueError: a size is not a positive int, heads do not divide, or the vocabulary is too small.
    """
    shape = shape or TinyShape()
    shape.validate()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_weights(directory, hf_config(family, shape), seed, identity_norm=_IDENTITY_NORM[family])
    build_tokenizer(shape.vocab_size).save(str(directory / "tokenizer.json"))
    _write_json(directory / "tokenizer_config.json", tokenizer_config(shape))
    return directory


def hf_config(family: ModelFamily, shape: TinyShape) -> dict[str, Any]:
    """The Hugging Face ``config.json`` fields of a ``family`` model of ``shape`` (float32)."""
    common: dict[str, Any] = {
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.max_position,
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "pad_token_id": None,
        # float32: CPUs without bf16 instructions run bf16 matmuls many times slower.
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
    }
    if family is ModelFamily.LLAMA:
        return {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
    if family is ModelFamily.GEMMA3:
        # Three window layers, then one full-attention layer (Gemma3 uses five to one; fewer layers here).
        layer_types = ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(shape.num_layers)]
        return {**common, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                "layer_types": layer_types, "sliding_window": shape.sliding_window,
                "query_pre_attn_scalar": shape.head_dim, "rms_norm_eps": 1e-6,
                "hidden_activation": "gelu_pytorch_tanh"}
    if family is ModelFamily.DEEPSEEK_V2:
        # Every layer dense (first_k_dense_replace): the experts' sizes are required fields but build nothing.
        return {**common, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "num_key_value_heads": shape.num_heads, "head_dim": shape.qk_rope_head_dim,
                "kv_lora_rank": shape.kv_lora_rank, "q_lora_rank": None,
                "qk_rope_head_dim": shape.qk_rope_head_dim, "qk_nope_head_dim": shape.qk_nope_head_dim,
                "v_head_dim": shape.v_head_dim, "first_k_dense_replace": shape.num_layers,
                "moe_intermediate_size": shape.intermediate_size, "n_routed_experts": 2, "n_shared_experts": 1,
                "num_experts_per_tok": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
                "moe_layer_freq": 1, "routed_scaling_factor": 1.0}
    # LFM2: ShortConv layers with an attention layer every other layer, starting with a conv layer.
    layer_types = ["full_attention" if i % 2 else "conv" for i in range(shape.num_layers)]
    del common["head_dim"]  # LFM2 derives it from hidden_size / num_attention_heads
    # conv_dim and block_dim: vLLM's lfm2.py reads them (real LFM2 checkpoints carry them, transformers'
    # Lfm2Config does not write them); both are the hidden size, which is what transformers builds.
    return {**common, "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "layer_types": layer_types,
            "conv_L_cache": shape.conv_kernel, "conv_bias": False, "norm_eps": 1e-5,
            "block_auto_adjust_ff_dim": False, "block_ff_dim": shape.intermediate_size,
            "conv_dim": shape.hidden_size, "block_dim": shape.hidden_size}


# The value of a norm's weight that makes it the identity: Gemma scales by (1 + weight), the others by weight.
_IDENTITY_NORM = {ModelFamily.LLAMA: 1.0, ModelFamily.GEMMA3: 0.0, ModelFamily.LFM2: 1.0,
                  ModelFamily.DEEPSEEK_V2: 1.0}


ATTENTION_GAIN = 2.0
"""Queries and keys are scaled by this, so attention logits have a spread of about 4 instead of 1: attention then
concentrates on a few positions, as in trained models, and one changed token moves the outputs clearly even in a
prompt of thousands of tokens (with a spread of 1 a 1,700-token prompt's outputs moved by as little as 0.03)."""
_QK_PROJECTIONS = ("q_proj", "k_proj")
_QK_NORMS = ("q_norm", "k_norm", "q_layernorm", "k_layernorm")


def write_weights(directory: Path, config: dict[str, Any], seed: int, *, identity_norm: float = 1.0) -> None:
    """Build the model of ``config`` with transformers, seed its weights, ``save_pretrained`` it as safetensors.

    Matrices get N(0, 1/fan_in), so activations keep their scale through every layer; vectors (norm weights) get
    ``identity_norm``. Query and key projections, or the norms applied to queries and keys where the model has
    them, are scaled by ``ATTENTION_GAIN``. Parameters are filled in name order from one generator: same seed,
    same bytes.
    """
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    hf = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() == 1:
                qk_norm = any(part in name for part in _QK_NORMS)
                param.fill_(identity_norm + (ATTENTION_GAIN - 1.0) if qk_norm else identity_norm)
            else:
                gain = ATTENTION_GAIN if any(part in name for part in _QK_PROJECTIONS) else 1.0
                param.copy_(torch.randn(param.shape, generator=gen) * (gain / math.sqrt(param.shape[-1])))
    model.save_pretrained(str(directory), safe_serialization=True)


def tokenizer_config(shape: TinyShape) -> dict[str, object]:
    """``tokenizer_config.json``: lets transformers load ``tokenizer.json`` as a fast tokenizer, offline."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "model_max_length": shape.max_position,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE with exactly ``vocab_size`` ids, trained on :func:`training_text` (deterministic)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer=trainer)
    # A small corpus can run out of merges; filler ids keep the vocabulary exactly the model's size so every
    # sampled id decodes.
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing > 0:
        tokenizer.add_tokens([f"<|fill{i}|>" for i in range(missing)])
    return tokenizer


def training_text(num_lines: int = 4000, seed: int = 0) -> Iterator[str]:
    """Sentences of made-up words (fixed seed): enough distinct pairs for about a thousand BPE merges."""
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "st", "tr", "pl"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ee"]
    codas = ["", "", "n", "r", "s", "t", "l", "nd", "ck"]
    words = [
        "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 3)))
        for _ in range(600)
    ]
    for _ in range(num_lines):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
        yield sentence.capitalize() + rng.choice([".", ".", "?", "!", ","])


def _write_json(path: Path, value: dict[str, object]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")

"""What names a block in vLLM: the namespace covers what decides the weights; a request's extra keys cover its LoRA
adapter by name and path (each length-prefixed) and each multimodal input with its place in the prompt. Built on
vLLM's own objects."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
from vllm.config import ModelConfig
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from kvoffload.config import OffloadConfig
from kvoffload.integrations.vllm.adapters import VllmRequest, weights_identity
from kvoffload.keys import Namespace, hash_blocks
from kvoffload.tools.vllm.model import ModelFamily, TinyShape, write_tiny_model

LINEAR_ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), ModelFamily.LLAMA, TinyShape(num_layers=1))


def fingerprint(model_config: ModelConfig, **config: Any) -> bytes:
    version = OffloadConfig.from_dict(config).model_version
    return Namespace("m", "float32", "layout", weights=weights_identity(model_config, version)).fingerprint()


def test_config_overrides_and_the_model_version_change_the_namespace(model_dir: Path) -> None:
    plain = ModelConfig(model=str(model_dir))
    scaled = ModelConfig(model=str(model_dir), hf_overrides={"rope_parameters": LINEAR_ROPE})
    assert fingerprint(plain) == fingerprint(ModelConfig(model=str(model_dir)))
    assert fingerprint(scaled) != fingerprint(plain)
    assert fingerprint(plain, model_version="ft-2") != fingerprint(plain)
    assert fingerprint(plain, model_version="ft-2") == fingerprint(plain, model_version="ft-2")


def test_where_the_model_lives_does_not_change_the_namespace(model_dir: Path, tmp_path: Path) -> None:
    moved = shutil.copytree(model_dir, tmp_path / "elsewhere")
    assert fingerprint(ModelConfig(model=str(moved))) == fingerprint(ModelConfig(model=str(model_dir)))


def test_revision_and_quantization_change_the_namespace(model_dir: Path) -> None:
    base = ModelConfig(model=str(model_dir))
    identity = weights_identity(base, None)
    for field, value in (("revision", "v2"), ("quantization", "fp8"), ("code_revision", "c1")):
        original = getattr(base, field)
        setattr(base, field, value)  # what vLLM would hold for a model loaded that way
        assert weights_identity(base, None) != identity, field
        setattr(base, field, original)


def request(lora: LoRARequest | None = None, mm: list[MultiModalFeatureSpec] | None = None,
            salt: str | None = None) -> VllmRequest:
    return VllmRequest(Request("r", list(range(64)), SamplingParams(), None, lora_request=lora, mm_features=mm,
                               cache_salt=salt))


def image(offset: int) -> list[MultiModalFeatureSpec]:
    return [MultiModalFeatureSpec(None, "image", "img-hash", PlaceholderRange(offset=offset, length=16))]


def old_lora_key(lora: LoRARequest) -> str:
    """The LoRA key before issue 21: name and path joined by a colon either of them may hold."""
    return f"lora:{lora.lora_name}:{lora.lora_path}"


def last_hash(r: VllmRequest) -> str:
    return hash_blocks(Namespace("m", "bf16", "pages=16").chain_root(), list(range(64)), 16, r.extra_keys)[-1].hex()


def test_a_lora_name_re_pointed_at_other_weights_is_another_key() -> None:
    a = request(LoRARequest("adapter", 1, "/loras/a"))
    b = request(LoRARequest("adapter", 1, "/loras/b"))
    assert a.extra_keys != b.extra_keys
    assert a.extra_keys == request(LoRARequest("adapter", 2, "/loras/a")).extra_keys


def test_lora_names_and_paths_that_join_to_the_same_text_are_other_keys() -> None:
    a, b = LoRARequest("a:b", 1, "c"), LoRARequest("a", 1, "b:c")
    assert old_lora_key(a) == old_lora_key(b)  # the old encoding gave both adapters one key
    assert request(a).extra_keys != request(b).extra_keys
    assert last_hash(request(a)) != last_hash(request(b))


def test_no_lora_key_equals_a_key_the_old_encoding_gave() -> None:
    # Blocks stored under old keys stay in shared tiers: a new key must never hit another adapter's.
    (key,) = request(LoRARequest("adapter", 1, "/loras/a")).extra_keys
    assert not key.startswith("lora:"), key  # every old LoRA key did


def test_requests_without_lora_keep_their_keys_exactly() -> None:
    # Values computed before the LoRA key changed: salt and multimodal keys were already unambiguous.
    salted = request(mm=image(4), salt="tenant-1")
    assert salted.extra_keys == ["salt:tenant-1", "mm:img-hash@4+16"]
    assert last_hash(salted) == "f452a9bdc339bb11d35da8398e699ff4"
    assert request().extra_keys == [] and last_hash(request()) == "ad363b76e6597c76e14f9039e5060bcb"


def test_the_same_image_at_another_place_in_the_prompt_is_another_key() -> None:
    assert request(mm=image(4)).extra_keys != request(mm=image(20)).extra_keys
    assert request(mm=image(4)).extra_keys == request(mm=image(4)).extra_keys


def test_a_requests_tenant_is_its_cache_salt_or_lora_name_and_none_without() -> None:
    from kvoffload.config import TenantBy

    both = request(LoRARequest("adapter", 1, "/loras/a"), salt="acme")
    assert both.tenant(TenantBy.CACHE_SALT) == "acme" and both.tenant(TenantBy.LORA) == "adapter"
    assert both.tenant(TenantBy.NONE) is None
    assert request().tenant(TenantBy.CACHE_SALT) is None and request().tenant(TenantBy.LORA) is None

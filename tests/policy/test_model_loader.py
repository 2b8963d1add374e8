"""Model loading: sources, the safetensors cache (atomic, keyed by GGUF sha256), the real model."""

import json

import pytest
import torch

from closedloop.contracts import SamplerConfig
from closedloop.engine import HFGenerator
from closedloop.policy import (
    ChatRenderer,
    ModelLoadError,
    build_tiny_model,
    embedded_gguf_path,
    load_model,
    tokenizer_revision,
    weights_checksum,
)
from closedloop.policy.model_loader import (
    CACHE_META,
    _write_cache,
    file_sha256,
    resolve_source,
)


def test_sources_resolve_without_loading(tmp_path):
    gguf = embedded_gguf_path()
    assert gguf.name.endswith(".gguf") and gguf.stat().st_size > 50_000_000
    assert resolve_source(None) == ("gguf", gguf) == resolve_source("embedded")
    assert resolve_source(gguf) == ("gguf", gguf)
    with pytest.raises(ModelLoadError):
        resolve_source(tmp_path)  # neither config.json nor a GGUF
    with pytest.raises(ModelLoadError):
        resolve_source("HuggingFaceTB/SmolLM2-135M-Instruct")  # hub names are never fetched
    with pytest.raises(ModelLoadError):
        load_model(None, dtype="float8")


def test_local_hf_folder_loads_with_identity(tokenizer, tmp_path):
    model = build_tiny_model(tokenizer, seed=2)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.source == "hf" and loaded.model_id == tmp_path.name
    assert loaded.weight_checksum == weights_checksum(model)
    assert loaded.tokenizer_revision == tokenizer_revision(tokenizer)
    half = load_model(tmp_path, dtype="bfloat16")
    assert half.weight_checksum != loaded.weight_checksum


def test_cache_write_is_atomic_and_losers_discard(tokenizer, tmp_path):
    model = build_tiny_model(tokenizer, seed=0)
    target = tmp_path / "abc"
    _write_cache(model, tokenizer, target, {"gguf_sha256": "x"})
    meta = json.loads((target / CACHE_META).read_text())
    assert meta["weight_checksum"] == weights_checksum(model)
    _write_cache(model, tokenizer, target, {"gguf_sha256": "x"})  # a concurrent loser
    assert sorted(p.name for p in tmp_path.iterdir()) == ["abc"]  # no temp dirs left


def test_cache_hit_is_read_and_verified(tokenizer, tmp_path):
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"not really a gguf")
    sha = file_sha256(fake)
    model = build_tiny_model(tokenizer, seed=4)
    cache = tmp_path / "cache"
    _write_cache(model, tokenizer, cache / sha[:16], {"gguf_sha256": sha})
    loaded = load_model(fake, cache_dir=cache)  # never parses the fake GGUF: the cache hits
    assert loaded.source == "cache" and loaded.weight_checksum == weights_checksum(model)
    assert loaded.model_id == f"m.gguf@sha256:{sha[:16]}"
    meta_path = cache / sha[:16] / CACHE_META
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps(dict(meta, weight_checksum="sha256:" + "0" * 64)))
    with pytest.raises(ModelLoadError, match="corrupted"):
        load_model(fake, cache_dir=cache)


def test_tokenizer_revision_ignores_runtime_padding(tokenizer):
    before = tokenizer_revision(tokenizer)
    tokenizer(["a", "a longer text"], padding=True, truncation=True, max_length=8)
    assert tokenizer_revision(tokenizer) == before


@pytest.mark.slow
def test_embedded_model_gguf_then_cache_round_trip(tmp_path):
    first = load_model(None, cache_dir=tmp_path)  # GGUF -> dequantize -> cache (~15-20 s)
    assert first.source == "gguf"
    assert getattr(first.model, "hf_quantizer", None) is None  # design §6: removed
    assert (tmp_path / first.model_id.split("sha256:")[1] / "model.safetensors").is_file()
    again = load_model("embedded", cache_dir=tmp_path)  # ~2 s
    assert again.source == "cache"
    assert again.weight_checksum == first.weight_checksum
    assert again.tokenizer_revision == first.tokenizer_revision
    assert again.model.config.num_hidden_layers == 30
    renderer = ChatRenderer(again.tokenizer, "You are helpful.", [])
    prompt = renderer.render_prompt("Say hello.")
    gen = HFGenerator(again.model, again.tokenizer, weight_checksum=again.weight_checksum)
    out = gen.generate(prompt, SamplerConfig(greedy=True), [], 4, seed=0)
    assert len(out.action_token_ids) <= 4 and out.raw_model_logprobs[0] > -5
    with torch.no_grad():
        ref = first.model(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    assert float(ref[out.action_token_ids[0]]) == pytest.approx(out.raw_model_logprobs[0],
                                                                abs=1e-4)

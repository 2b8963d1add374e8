"""Weight identity: a canonical checksum of a model's tensors.

``weights_checksum(model)`` is the policy-version identity used in the PolicyManifest
(``weight_checksum``) and reported by generators. It is

    sha256( for name in sorted(state_dict):
                utf8(name) 0x00 utf8(dtype) 0x00 utf8(shape) 0x00 len(bytes) 0x00 bytes )

over every tensor of ``model.state_dict()`` (parameters and persistent buffers), in the tensors'
own dtype and C-contiguous byte order (little-endian on every supported platform). Two models have
equal checksums exactly when they hold the same tensor names, dtypes, shapes and bits: casting to
another dtype, changing one weight, or adding a LoRA adapter changes it; re-loading the same
weights from disk does not. Tied tensors (the input embedding and ``lm_head`` of SmolLM2) appear
under both names and are hashed under both names. Cost: ~0.5 s for SmolLM2-135M (540 MB fp32).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping

import torch

from closedloop.contracts import sha256_hex

HASH_PREFIX = "sha256:"


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Return the raw bytes of ``t`` (detached, CPU, C-contiguous), copying only if needed."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


def _records(named: Iterable[tuple[str, torch.Tensor]]
             ) -> Iterator[tuple[str, bytes, memoryview]]:
    """``(name, header, bytes)`` of each tensor, sorted by name: what the module doc hashes."""
    for name, t in sorted(named, key=lambda kv: kv[0]):
        data = tensor_bytes(t)
        header = f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{tuple(t.shape)}\0{data.nbytes}\0"
        yield name, header.encode("utf-8"), data


def checksum_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Return ``sha256:<hex>`` over ``(name, tensor)`` pairs, sorted by name (see module doc)."""
    h = hashlib.sha256()
    for _, header, data in _records(named):
        h.update(header)
        h.update(data)
    return HASH_PREFIX + h.hexdigest()


def state_dict_checksum(state: Mapping[str, torch.Tensor]) -> str:
    """Return the checksum of a state dict (name -> tensor)."""
    return checksum_tensors(state.items())


def weights_checksum(model: torch.nn.Module) -> str:
    """Return the canonical checksum of ``model.state_dict()`` (see module doc)."""
    return state_dict_checksum(model.state_dict())


def combine_checksums(base: str, adapter: str | None) -> str:
    """Return the single policy-version checksum of base weights plus an optional adapter.

    Without an adapter it is ``base`` itself; with one it is
    ``sha256("closedloop-policy-v1\\0" + base + "\\0" + adapter)``.
    """
    if adapter is None:
        return base
    return sha256_hex(f"closedloop-policy-v1\0{base}\0{adapter}")


def tensor_digests(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Per-tensor checksums, ``name -> checksum_tensors([(name, tensor)])``: what a replica
    compares tensor by tensor, so a mismatch names the tensor that differs."""
    return {name: checksum_tensors([(name, t)]) for name, t in sorted(state.items())}


def checksum_and_digests(state: Mapping[str, torch.Tensor]) -> tuple[str, dict[str, str]]:
    """``(state_dict_checksum(state), tensor_digests(state))`` from one walk over the tensors'
    bytes (each byte still passes both hashes). The vLLM engine process, which cannot import
    closedloop, hashes with its own copy of this walk (``closedloop.engine.vllm_server
    .hash_tensors``); a test holds the two equal."""
    whole, digests = hashlib.sha256(), {}
    for name, header, data in _records(state.items()):
        whole.update(header)
        whole.update(data)
        one = hashlib.sha256(header)
        one.update(data)
        digests[name] = HASH_PREFIX + one.hexdigest()
    return HASH_PREFIX + whole.hexdigest(), digests

"""LoRA adapters (peft) and the policy-version checksum of base + adapter.

``attach_lora`` wraps a causal LM in a peft ``PeftModel`` with a seeded initialization (A ~
Kaiming-uniform from ``seed``, B = 0, so the adapted model starts equal to the base) and dropout 0
by default, so the trainer's log-probs are a deterministic function of the weights, like the
generator's.

A LoRA policy version is base revision + adapter revision (docs/concepts.md, atomic weight
publication). ``policy_weight_checksum`` returns both and their combination
(``weights.combine_checksums``), which is the manifest's ``weight_checksum``. The base checksum
uses the base model's own tensor names (peft's ``base_model.model.`` prefix and ``.base_layer``
segment removed), so it equals ``weights_checksum`` of the un-adapted model; the adapter
checksum covers every other tensor (``lora_A``, ``lora_B``, ...) under its in-memory name.

Both ``attach_lora`` and ``load_adapter`` switch the adapted projections to
``closedloop.policy.lora_product.FusedLoraLinear`` (the adapted product in one GEMM; same
parameters, same state-dict names, peft's own forward wherever the fusion does not apply).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch

from closedloop.errors import AdapterError
from closedloop.policy.weights import (
    checksum_and_digests,
    checksum_tensors,
    combine_checksums,
    weights_checksum,
)

PEFT_PREFIX = "base_model.model."
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class PolicyChecksum(NamedTuple):
    """The identity of a policy's weights: base, adapter (None without one), combined."""

    base_checksum: str
    adapter_checksum: str | None
    combined: str


def attach_lora(model: Any, r: int = 8, alpha: int = 16,
                target_modules: Sequence[str] = DEFAULT_TARGETS, seed: int = 0,
                dropout: float = 0.0) -> Any:
    """Return ``model`` wrapped with a fresh LoRA adapter (rank ``r``, scale ``alpha / r``).

    Only the adapter's parameters require gradients. The global RNG is left untouched.
    """
    from peft import LoraConfig, get_peft_model

    from closedloop.policy.lora_product import fuse_lora_products

    if r < 1 or alpha <= 0:
        raise AdapterError(f"LoRA needs r >= 1 and alpha > 0, got r={r}, alpha={alpha}")
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules),
                        lora_dropout=dropout, bias="none", task_type="CAUSAL_LM")
    devices: list[torch.device] = []
    with torch.random.fork_rng(devices=devices), _quiet_peft():
        torch.manual_seed(seed)
        wrapped = get_peft_model(model, config)
    fuse_lora_products(wrapped)
    return wrapped


@contextmanager
def _quiet_peft() -> Iterator[None]:
    """Silence the one deprecation warning peft triggers in transformers on every wrap
    (peft reads ``is_gradient_checkpointing``, which transformers renamed); nothing else."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.* is deprecated",
                                category=FutureWarning)
        yield


def is_peft_model(model: Any) -> bool:
    """Say whether ``model`` is a peft ``PeftModel``."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def adapter_is_inert(model: Any) -> bool:
    """Whether ``model``'s LoRA adapter adds exactly nothing to its base: it has plain LoRA
    layers only (no DoRA, no LoRA bias, no ``modules_to_save``, no other tuner), and every
    active adapter's ``B`` factor is zero, as a fresh adapter's is before its first step.
    Each adapted layer then computes ``base(x) + s * B(A(x)) = base(x) + 0``: the policy and
    the base under ``disable_adapter`` are the same function, bit for bit."""
    if not is_peft_model(model):
        return False
    found = False
    for module in model.modules():
        if type(module).__name__ == "ModulesToSaveWrapper":
            return False
        lora_b = getattr(module, "lora_B", None)
        if lora_b is None or not hasattr(module, "base_layer"):
            continue
        dora = getattr(module, "use_dora", {}) or {}
        for name in module.active_adapters:
            if name not in lora_b:
                continue
            b = lora_b[name]
            if dora.get(name) or not isinstance(b, torch.nn.Linear) or b.bias is not None \
                    or bool(b.weight.any()):
                return False
            found = True
        if getattr(module, "lora_embedding_B", None):
            return False
    return found


def split_state_dict(model: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Return ``(base, adapter)`` state dicts of a model, the tensors the checksums cover.

    base: the base model's tensors under its own names (peft's ``base_model.model.`` prefix and
    ``.base_layer`` segment removed). adapter: every LoRA tensor (``lora_*``,
    ``modules_to_save``) under its in-memory peft name; empty for a plain model. Stage exactly
    this adapter dict in the policy registry so its checksum equals ``adapter_checksum``.
    """
    if not is_peft_model(model):
        return dict(model.state_dict()), {}
    base: dict[str, torch.Tensor] = {}
    adapter: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        is_adapter, key = _split_name(name)
        (adapter if is_adapter else base)[key] = tensor
    return base, adapter


def _split_name(name: str) -> tuple[bool, str]:
    """``(is_adapter, key)`` of a peft state-dict entry (``split_state_dict``'s rule): an adapter
    tensor keeps its peft name; a base tensor loses the peft prefix and ``.base_layer``."""
    plain = name.removeprefix(PEFT_PREFIX)
    if "lora_" in plain or "modules_to_save" in plain:
        return True, name
    return False, plain.replace(".base_layer.", ".")


class SplitView:
    """``split_state_dict`` of one model with its module tree walked once.

    ``model.state_dict()`` walks every module (~1,600 for a LoRA-wrapped SmolLM2, ~4 ms) on
    each call; a role reads its split several times per published version (its checksum, the
    adapter it copies, hashes and loads into). The view records, once, which module holds
    each state-dict entry and reads the entries from those modules on every call, so a
    parameter or buffer that was replaced (``module.weight = ...``, ``load_state_dict(...,
    assign=True)``) is the new one. The module tree itself must not change after the view is
    made (no module added, removed or swapped: the roles never restructure their models);
    where the recorded entries do not reproduce ``model.state_dict()`` (a state-dict hook
    renames or adds entries) the view falls back to ``split_state_dict`` on every call.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self._plan: list[tuple[str, bool, Any, str, bool]] | None = None
        self._exact = True

    def __call__(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``(base, adapter)``, as ``split_state_dict(model)`` returns them now."""
        if not self._exact or not is_peft_model(self.model):
            return split_state_dict(self.model)
        if self._plan is None:
            self._plan = self._record()
            if self._plan is None:
                self._exact = False
                return split_state_dict(self.model)
        base: dict[str, torch.Tensor] = {}
        adapter: dict[str, torch.Tensor] = {}
        for name, is_adapter, module, key, is_param in self._plan:
            tensor = (module._parameters if is_param else module._buffers).get(key)
            if tensor is None:  # an entry was removed: the recorded walk no longer holds
                self._plan = None
                return self()
            (adapter if is_adapter else base)[name] = tensor.detach()
        return base, adapter

    def _record(self) -> list[tuple[str, bool, Any, str, bool]] | None:
        plan = []
        for prefix, module in self.model.named_modules(remove_duplicate=False):
            head = f"{prefix}." if prefix else ""
            for key, tensor in module._parameters.items():
                if tensor is not None:
                    plan.append((head + key, module, key, True))
            for key, tensor in module._buffers.items():
                if tensor is not None and key not in module._non_persistent_buffers_set:
                    plan.append((head + key, module, key, False))
        state = self.model.state_dict()
        if [e[0] for e in plan] != list(state) or any(
                state[name].data_ptr() != (module._parameters if is_param else module._buffers)[
                    key].data_ptr() for name, module, key, is_param in plan):
            return None
        out = []
        for name, module, key, is_param in plan:
            is_adapter, split_name = _split_name(name)
            out.append((split_name, is_adapter, module, key, is_param))
        return out


def policy_weight_checksum(model: Any) -> PolicyChecksum:
    """Return base, adapter and combined checksums of a plain or LoRA-wrapped model."""
    if not is_peft_model(model):
        base = weights_checksum(model)
        return PolicyChecksum(base, None, base)
    base_sd, adapter_sd = split_state_dict(model)
    base = checksum_tensors(base_sd.items())
    adapter = checksum_tensors(adapter_sd.items())
    return PolicyChecksum(base, adapter, combine_checksums(base, adapter))


def save_adapter(model: Any, path: str | Path) -> Path:
    """Save the adapter (weights + config only) to ``path`` atomically; return ``path``."""
    if not is_peft_model(model):
        raise AdapterError("save_adapter needs a peft model (attach_lora first)")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tmp.chmod(0o755)
        if target.exists():
            raise AdapterError(f"{target} exists; adapters are never overwritten")
        os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_adapter(base_model: Any, path: str | Path, trainable: bool = False) -> Any:
    """Return ``base_model`` wrapped with the adapter saved at ``path``."""
    from peft import PeftModel

    from closedloop.policy.lora_product import fuse_lora_products

    if not (Path(path) / "adapter_config.json").is_file():
        raise AdapterError(f"{path} holds no adapter_config.json")
    with _quiet_peft():
        wrapped = PeftModel.from_pretrained(base_model, str(path), is_trainable=trainable)
    fuse_lora_products(wrapped)
    return wrapped


class PolicyChecksummer:
    """``policy_weight_checksum`` of one model, the base's part kept while the base is unchanged.

    A LoRA run never writes its base after the warm start, and hashing a 135M base costs ~0.7 s,
    so the base checksum is computed once and recomputed only when a base tensor's storage or
    version counter moved (every in-place update bumps it: optimizer steps, ``copy_``,
    ``load_state_dict``). A write through ``.data`` bypasses the counter: create the
    checksummer after such writes (``merge_and_unload``), or call ``invalidate``. The adapter's
    tensors are hashed on every call: they are what changes.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.split = SplitView(model)
        self._key: tuple[tuple[str, int, int], ...] | None = None
        self._base: str | None = None

    def invalidate(self) -> None:
        """Forget the base checksum (the next call hashes the base again)."""
        self._key = self._base = None

    def __call__(self) -> PolicyChecksum:
        """Base, adapter and combined checksums of the model's tensors as they are now."""
        if not is_peft_model(self.model):
            base = weights_checksum(self.model)
            return PolicyChecksum(base, None, base)
        base_sd, adapter_sd = self.split()
        base = self._base_checksum(base_sd)
        adapter = checksum_tensors(adapter_sd.items())
        return PolicyChecksum(base, adapter, combine_checksums(base, adapter))

    def with_digests(self) -> tuple[PolicyChecksum, dict[str, str]]:
        """The checksums and each adapter tensor's checksum (``tensor_digests``), from one walk
        over the adapter's bytes (a model without an adapter has no digests)."""
        if not is_peft_model(self.model):
            return self(), {}
        base_sd, adapter_sd = self.split()
        base = self._base_checksum(base_sd)
        adapter, digests = checksum_and_digests(adapter_sd)
        return PolicyChecksum(base, adapter, combine_checksums(base, adapter)), digests

    def with_adapter(self, adapter_checksum: str) -> PolicyChecksum:
        """The checksums given the adapter's, taken from a copy of the adapter as it is now
        (only the base's part is looked up, recomputed if the base moved)."""
        base = self._base_checksum(self.split()[0])
        return PolicyChecksum(base, adapter_checksum, combine_checksums(base, adapter_checksum))

    def _base_checksum(self, base_sd: dict[str, torch.Tensor]) -> str:
        key = tuple((name, t.data_ptr(), t._version) for name, t in sorted(base_sd.items()))
        if key != self._key or self._base is None:
            self._base, self._key = checksum_tensors(base_sd.items()), key
        return self._base

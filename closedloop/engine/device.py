"""Where the policy computes: the CPU, or a CUDA GPU when one is present.

``resolve_device("auto")`` is ``cuda`` when torch sees a CUDA device, else ``cpu``; ``cpu`` and
``cuda`` are taken as asked (``cuda`` without a device raises ``PrecisionError``). A run places
its model on that device once; everything else follows the model:

- the log-prob paths (``trainer_path_logprobs``, ``shared_prefix_logprobs``,
  ``sequence_logprobs``) take ids and masks on any device, compute on the model's, and return
  their result on the ids' device (autograd flows through the transfer), so the trainer, the
  auditor and the warm start keep their batches and bookkeeping on the CPU;
- the generator builds its inputs on the model's device and draws its sampling uniforms from
  CPU generators (the same draws on every device: a seed means the same thing on a GPU).
"""

from __future__ import annotations

from typing import Any

import torch

from closedloop.errors import PrecisionError

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(requested: str) -> str:
    """``auto`` -> ``cuda`` if available else ``cpu``; ``cpu``/``cuda`` as asked."""
    if requested not in DEVICES:
        raise PrecisionError(f"device must be one of {DEVICES}, got {requested!r}")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise PrecisionError("training.device: cuda, but torch sees no CUDA device")
    return requested


def model_device(model: Any) -> torch.device:
    """The device of a model's first parameter (CPU for a model without parameters)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def device_label(device: str | torch.device) -> str:
    """``cpu``, or ``cuda:<name>`` (what benchmarks and reports label figures with)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(dev)}"
    return dev.type


def to_model_device(model: Any, *tensors: torch.Tensor | None
                    ) -> tuple[torch.Tensor | None, ...]:
    """``tensors`` moved to ``model``'s device (None stays None; a no-op on the same device)."""
    dev = model_device(model)
    return tuple(None if t is None else t.to(dev) for t in tensors)

"""The CPU engine: how the policy is run fast, behind two interfaces.

- **generation**: ``HFGenerator`` implements ``closedloop.policy.generator.Generator`` (and the
  stateful session API the collector drives) on its own decode copy of the weights, with
  per-session KV caches;
- **log-prob scoring**: ``trainer_path_logprobs`` (what the trainer and the auditor score),
  ``sequence_logprobs`` (one row at a time, what SFT scores) and ``shared_prefix_logprobs``:
  float32 ``[B, T-1]``, ``out[b, t] = log softmax(z / τ)[x[b, t+1]]`` at target positions, else
  0, with ``z`` the model's logits at ``t`` and ``τ`` the sampler's temperature;
- **precision**: ``matmul_precision(model, name)`` runs every ``nn.Linear`` of ``model`` in
  ``float32`` or ``bfloat16`` matmuls inside a block; ``check_precision``/``precision_label``
  name it;
- **precision policy**: ``resolve_precision`` / ``resolve_for_run`` decide a run's precision once
  from the host (``CpuFacts``: native bf16 from the CPU flags, else a measured race), recorded
  as a ``PrecisionChoice``;
- **native kernels**: ``decode_attention`` (decode attention over a grouped-query cache as two C
  loops built for this host, ``None`` where they do not apply; ``matmul_decode_attention`` is the
  torch form); ``native_unavailable_reason``
  says why they are not built here (``CLOSEDLOOP_NATIVE=0``, ``NATIVE_ENV``, turns them off);
- **allocator**: ``tune_allocator`` keeps freed tensor memory in the process (glibc);
  ``release_free_memory`` hands it back once;
- **device**: ``resolve_device`` (the CPU, or CUDA when present), ``model_device``,
  ``device_label``; the log-prob paths compute on the model's device and return on the ids';
- **vLLM**: ``VLLMGenerator`` (the same generator and session API) over a ``VLLMEngine``, a
  vLLM process in its own environment (``vllm_unavailable_reason`` says why it cannot run), and
  ``VLLMReplica``, which acknowledges a published version only after hashing what its engine
  loaded and matching the trainer's probe log-probs (``publish_proven``).

``closedloop.engine.transformers_path`` holds the plain transformers path the fast ones are tested
against (``reference_logprobs``, ``reference_generate``). Code outside the engine imports only
this package; the private internals the speed work relies on (oneDNN ops, a transformers cache
layer subclass, rebinding ``nn.Linear.forward``) stay in its submodules. Importing it loads no
model and imports no ``transformers``.
"""

from closedloop.engine.allocator import release_free_memory, tune_allocator
from closedloop.engine.attention_loops import (
    decode_attention,
    matmul_decode_attention,
    native_unavailable_reason,
)
from closedloop.engine.device import DEVICES, device_label, model_device, resolve_device
from closedloop.engine.hf_generator import GeneratorStats, HFGenerator, SessionId
from closedloop.engine.host_precision import (
    CpuFacts,
    MatmulRates,
    PrecisionChoice,
    measure_matmul_rates,
    read_cpu_facts,
    resolve_for_run,
    resolve_on_cuda,
    resolve_precision,
    warn_if_emulated,
)
from closedloop.engine.logprobs import sequence_logprobs
from closedloop.engine.native_build import DISABLE_ENV as NATIVE_ENV
from closedloop.engine.precision import (
    PRECISIONS,
    check_precision,
    drop_bf16_copies,
    matmul_precision,
    precision_label,
)
from closedloop.engine.prefix_logprobs import (
    common_prefix_lengths,
    prompt_prefix_lengths,
    shared_prefix_logprobs,
    trainer_path_logprobs,
)
from closedloop.engine.transformers_path import reference_generate, reference_logprobs
from closedloop.engine.vllm_engine import EngineConfig, VLLMEngine, vllm_unavailable_reason
from closedloop.engine.vllm_generator import VLLMGenerator
from closedloop.engine.vllm_replica import (
    LoraLayout,
    Probe,
    ReplicaProof,
    VLLMReplica,
    publish_proven,
    trainer_probe_reference,
)
from closedloop.engine.vllm_server import hash_model_folder
from closedloop.errors import LogprobInputError, PrecisionError

__all__ = [  # noqa: RUF022 -- grouped by topic, sorted within each group
    # generation
    "GeneratorStats", "HFGenerator", "SessionId",
    # log-prob scoring
    "LogprobInputError", "common_prefix_lengths", "prompt_prefix_lengths", "sequence_logprobs",
    "shared_prefix_logprobs", "trainer_path_logprobs",
    # the plain transformers reference
    "reference_generate", "reference_logprobs",
    # matmul precision
    "PRECISIONS", "PrecisionError", "check_precision", "drop_bf16_copies", "matmul_precision",
    "precision_label",
    # the precision policy
    "CpuFacts", "MatmulRates", "PrecisionChoice", "measure_matmul_rates", "read_cpu_facts",
    "resolve_for_run", "resolve_precision", "warn_if_emulated",
    # native kernels
    "NATIVE_ENV", "decode_attention", "matmul_decode_attention", "native_unavailable_reason",
    # allocator
    "release_free_memory", "tune_allocator",
    # device
    "DEVICES", "device_label", "model_device", "resolve_device", "resolve_on_cuda",
    # vLLM
    "EngineConfig", "LoraLayout", "Probe", "ReplicaProof", "VLLMEngine", "VLLMGenerator",
    "VLLMReplica", "hash_model_folder", "publish_proven", "trainer_probe_reference",
    "vllm_unavailable_reason",
]

"""The policy layer: what the policy *is*. Model loading, chat rendering on token ids, the
``Generator`` contract and the sampler's distribution, weight checksums, LoRA, the registry.

How the policy is run fast (the generator, trainer-path log-probs, matmul precision) is the
engine's (``closedloop.engine``), which builds on this layer. Importing this package loads no
model and imports no ``transformers``/``peft`` (they are imported inside the functions that need
them).
"""

from closedloop.errors import (
    AdapterError,
    ChatTemplateError,
    ContextOverflowError,
    GenerationError,
    ModelLoadError,
)
from closedloop.policy.chat import (
    CHATML_TOOLS,
    ChatMessage,
    ChatMLToolTemplate,
    ChatRenderer,
    SampleTurn,
    TemplateReport,
    check_append_only,
)
from closedloop.policy.generator import (
    FinishReason,
    Generation,
    Generator,
    StopMatcher,
    default_stop_token_ids,
)
from closedloop.policy.lora import (
    PolicyChecksum,
    attach_lora,
    load_adapter,
    policy_weight_checksum,
    save_adapter,
    split_state_dict,
)
from closedloop.policy.model_loader import (
    LoadedModel,
    embedded_gguf_path,
    load_model,
    load_tokenizer,
    tokenizer_revision,
)
from closedloop.policy.sampling import sample, sample_step, transform_logits
from closedloop.policy.tiny_model import build_tiny_model, load_embedded_tokenizer
from closedloop.policy.weights import combine_checksums, weights_checksum

__all__ = [  # noqa: RUF022 -- grouped by topic, sorted within each group
    # loading
    "LoadedModel", "ModelLoadError", "build_tiny_model", "embedded_gguf_path",
    "load_embedded_tokenizer", "load_model", "load_tokenizer", "tokenizer_revision",
    # chat rendering on token ids
    "CHATML_TOOLS", "ChatMLToolTemplate", "ChatMessage", "ChatRenderer", "ChatTemplateError",
    "SampleTurn", "TemplateReport", "check_append_only",
    # the generator contract and the sampler's distribution
    "ContextOverflowError", "FinishReason", "Generation", "GenerationError", "Generator",
    "StopMatcher", "default_stop_token_ids", "sample", "sample_step", "transform_logits",
    # weights identity and LoRA
    "AdapterError", "PolicyChecksum", "attach_lora", "combine_checksums", "load_adapter",
    "policy_weight_checksum", "save_adapter", "split_state_dict", "weights_checksum",
]

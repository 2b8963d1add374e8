"""The vLLM engine process: JSON lines on stdin/stdout, run by the vLLM environment's python.

closedloop never imports vllm. This file runs as a script under ``.vllm-venv/bin/python``
(``scripts/setup-vllm``), whose pins (transformers < 5.20) clash with closedloop's, and imports
only the standard library, torch and safetensors at module level, so closedloop's own tests can
import it to check that its hashing recipe is closedloop's (``closedloop.policy.weights``).

Protocol (one JSON object per line; ``vllm_engine.VLLMEngine`` is the client):

- argv[1]: the engine config ``{"model", "seed", "max_model_len", "max_lora_rank",
  "max_loras", "adapter_name"}``. The engine runs float32, eager, with prefix caching and
  ``logprobs_mode="processed_logprobs"``: a sampled token's log-prob is taken from the
  distribution that sampled it (after temperature), never the raw model's.
- first line out: ``{"ready": true, "pid", "startup_s", "vllm_version", "logprobs_mode",
  "base_checksum", "base_digests"}``: the checksum and per-tensor digests of the weights files
  the engine was started on (``hash_model_folder``).
- then one reply per request, carrying the request's ``id``: ``generate`` (token-id prompts,
  one seed and one adapter (or none) each, ``logprobs=0``: exactly the sampled id's
  log-prob), ``score`` (log-probs of given ids at temperature 1 via ``prompt_logprobs``),
  ``load_lora`` (register an adapter under a fresh name and id, then hash the file it read),
  ``remove_lora``, ``list_loras``, ``reset_prefix_cache``, ``shutdown``. A failed request
  answers ``{"id", "error", "trace", "fatal"}``; the process keeps serving unless the engine
  itself died (``fatal``: it then exits). End of stdin ends it.

stdout carries only the protocol: vLLM (and the engine processes it spawns) log to stdout, so
file descriptor 1 is pointed at stderr before vllm is imported and replies go to a duplicate of
the original descriptor.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any

LOGPROBS_MODE = "processed_logprobs"
HASH_PREFIX = "sha256:"
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
              "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
              "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


# ----------------------------------------------------------------------------- hashing
def _header(name: str, tensor: Any) -> bytes:
    dtype = str(tensor.dtype).removeprefix("torch.")
    nbytes = tensor.numel() * tensor.element_size()
    return f"{name}\0{dtype}\0{tuple(tensor.shape)}\0{nbytes}\0".encode()


def _raw(tensor: Any) -> Any:
    import torch

    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data


def hash_tensors(named: Iterable[tuple[str, Any]]) -> tuple[str, dict[str, str]]:
    """Return ``(checksum, digests)`` of ``(name, tensor)`` pairs.

    ``checksum`` is closedloop's weight checksum (``closedloop.policy.weights.checksum_tensors``:
    sha256 over ``name 0 dtype 0 shape 0 nbytes 0 bytes`` of every tensor, sorted by name);
    ``digests[name]`` is the sha256 of that one tensor's record (``tensor_digests``).
    """
    whole = hashlib.sha256()
    digests: dict[str, str] = {}
    for name, tensor in sorted(named, key=lambda kv: kv[0]):
        header, data = _header(name, tensor), _raw(tensor)
        whole.update(header)
        whole.update(data)
        one = hashlib.sha256(header)
        one.update(data)
        digests[name] = HASH_PREFIX + one.hexdigest()
    return HASH_PREFIX + whole.hexdigest(), digests


def hash_model_folder(folder: str | Path) -> tuple[str, dict[str, str]]:
    """Hash the safetensors weights of a model folder as the policy's state dict names them.

    A model with tied input and output embeddings saves ``embed_tokens`` once; its state dict
    (what the trainer hashes) holds the same tensor under ``lm_head.weight`` too, so it is
    hashed under both names.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no .safetensors weights")
    tensors: dict[str, Any] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    config = json.loads((folder / "config.json").read_text("utf-8"))
    if config.get("tie_word_embeddings") and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    return hash_tensors(tensors.items())


def peft_name_to_policy(name: str, adapter_name: str) -> str:
    """The in-memory name of a saved peft tensor: ``...lora_A.weight`` ->
    ``...lora_A.<adapter_name>.weight`` (the names the policy registry stores and hashes)."""
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.weight", f".{part}.{adapter_name}.weight")
    return name


def hash_adapter_folder(folder: str | Path, adapter_name: str) -> tuple[str, dict[str, str]]:
    """Hash a peft adapter folder's tensors under their in-memory names
    (``peft_name_to_policy``): the recipe of the manifest's ``adapter_checksum``."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(folder) / "adapter_model.safetensors"))
    return hash_tensors((peft_name_to_policy(k, adapter_name), v) for k, v in tensors.items())


# ----------------------------------------------------------------------------- the engine
class _Server:
    """The engine and the handlers of the protocol's commands."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        from vllm import LLM

        self.cfg = cfg
        self.adapter_name = str(cfg.get("adapter_name", "default"))
        self.llm = LLM(model=cfg["model"], dtype="float32", enforce_eager=True,
                       max_model_len=int(cfg.get("max_model_len", 2048)),
                       logprobs_mode=LOGPROBS_MODE, enable_prefix_caching=True,
                       seed=int(cfg.get("seed", 0)), enable_lora=True,
                       max_lora_rank=int(cfg.get("max_lora_rank", 16)),
                       max_loras=int(cfg.get("max_loras", 2)))

    def _lora(self, spec: dict[str, Any] | None) -> Any:
        if not spec:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(str(spec["name"]), int(spec["id"]), str(spec["path"]))

    def _loras(self, req: dict[str, Any], n: int) -> list[Any]:
        """One LoRA request (or None: the base weights) per prompt."""
        specs = req.get("loras") or [None] * n
        if len(specs) != n:
            raise ValueError(f"{len(specs)} adapters for {n} prompts")
        return [self._lora(spec) for spec in specs]

    def generate(self, req: dict[str, Any]) -> dict[str, Any]:
        """Sample one completion per prompt, each with its own seed."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts, seeds = req["prompts"], req["seeds"]
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts for {len(seeds)} seeds")
        params = [SamplingParams(n=1, temperature=float(req["temperature"]), top_p=1.0,
                                 top_k=0, max_tokens=int(req["max_tokens"]), seed=int(s),
                                 logprobs=0, stop=list(req.get("stop") or []) or None,
                                 stop_token_ids=list(req.get("stop_token_ids") or []),
                                 include_stop_str_in_output=True, skip_special_tokens=False,
                                 detokenize=True)
                  for s in seeds]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                 params, lora_request=self._loras(req, len(prompts)),
                                 use_tqdm=False)
        results = []
        for out in outs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            lps = [d[t].logprob for d, t in zip(c.logprobs, ids, strict=True)]
            results.append({"token_ids": ids, "logprobs": lps,
                            "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason})
        return {"results": results}

    def score(self, req: dict[str, Any]) -> dict[str, Any]:
        """Log-probs (temperature 1, the raw model) of ``sequences[i][starts[i]:]``."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        seqs, starts = req["sequences"], req["starts"]
        params = SamplingParams(n=1, temperature=1.0, max_tokens=1, prompt_logprobs=0,
                                detokenize=False)
        results = []
        # One request at a time: vLLM-CPU 0.32's LoRA logits path (active whenever the engine
        # serves adapters) indexes adapters per request, not per prompt row, so a batch of
        # several prompt-log-prob requests fails its einsum and kills the engine; a single
        # request's one index covers all of its rows.
        for seq, start, lora in zip(seqs, starts, self._loras(req, len(seqs)), strict=True):
            (out,) = self.llm.generate([TokensPrompt(prompt_token_ids=list(seq))], params,
                                       lora_request=lora, use_tqdm=False)
            lps = out.prompt_logprobs  # [None, {id: Logprob}, ...] per prompt position
            results.append([lps[i][seq[i]].logprob for i in range(int(start), len(seq))])
        return {"logprobs": results}

    def load_lora(self, req: dict[str, Any]) -> dict[str, Any]:
        """Register an adapter (``req["lora"]``), then hash the very file the engine read."""
        ok = self.llm.llm_engine.add_lora(self._lora(req["lora"]))
        checksum, digests = hash_adapter_folder(req["lora"]["path"], self.adapter_name)
        return {"ok": bool(ok), "adapter_checksum": checksum, "adapter_digests": digests,
                "loras": sorted(self.llm.llm_engine.list_loras())}

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        """Dispatch one request; raises on a bad request."""
        cmd = req.get("cmd")
        if cmd == "generate":
            return self.generate(req)
        if cmd == "score":
            return self.score(req)
        if cmd == "load_lora":
            return self.load_lora(req)
        if cmd == "remove_lora":
            return {"ok": bool(self.llm.llm_engine.remove_lora(int(req["lora_id"]))),
                    "loras": sorted(self.llm.llm_engine.list_loras())}
        if cmd == "list_loras":
            return {"loras": sorted(self.llm.llm_engine.list_loras())}
        if cmd == "reset_prefix_cache":
            return {"ok": bool(self.llm.reset_prefix_cache())}
        raise ValueError(f"unknown command {cmd!r}")


def main() -> None:
    """Serve requests until ``shutdown`` or the end of stdin (see the module doc)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)

    def send(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    t0 = time.time()
    cfg = json.loads(sys.argv[1])
    base_checksum, base_digests = hash_model_folder(cfg["model"])
    import vllm

    server = _Server(cfg)
    send({"ready": True, "pid": os.getpid(), "startup_s": time.time() - t0,
          "vllm_version": vllm.__version__, "logprobs_mode": LOGPROBS_MODE,
          "base_checksum": base_checksum, "base_digests": base_digests})
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        rid = req.get("id")
        if req.get("cmd") == "shutdown":
            send({"id": rid, "ok": True})
            break
        t = time.time()
        try:
            reply = server.handle(req)
        except Exception as exc:  # the client raises; a dead engine ends the process
            fatal = type(exc).__name__ == "EngineDeadError"
            send({"id": rid, "error": repr(exc), "trace": traceback.format_exc()[-3000:],
                  "fatal": fatal})
            if fatal:
                sys.exit(3)
            continue
        send({"id": rid, "elapsed_s": time.time() - t, **reply})


if __name__ == "__main__":
    main()

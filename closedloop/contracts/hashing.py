"""Canonical JSON and content hashes.

Every contract record has one canonical serialization: JSON with sorted keys, no insignificant
whitespace, UTF-8, and no NaN or infinity. Its content hash is ``"sha256:" + hex(sha256(bytes))``.
Two records are the same record exactly when their canonical forms are byte-equal.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

HASH_PREFIX = "sha256:"


def canonical_json(obj: Any) -> str:
    """Serialize ``obj`` canonically: sorted keys, compact separators, finite floats only.

    Raises ``ValueError`` for NaN or infinite floats and ``TypeError`` for values JSON cannot hold.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def sha256_hex(data: bytes | str) -> str:
    """Return ``"sha256:<hex>"`` of ``data`` (a ``str`` is encoded as UTF-8)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    return HASH_PREFIX + hashlib.sha256(raw).hexdigest()


def content_hash(obj: Any) -> str:
    """Return the content hash of ``obj``: the sha256 of its canonical JSON."""
    return sha256_hex(canonical_json(obj))


def is_content_hash(value: object) -> bool:
    """Say whether ``value`` looks like a content hash produced by this module."""
    if not isinstance(value, str) or not value.startswith(HASH_PREFIX):
        return False
    digest = value[len(HASH_PREFIX):]
    return len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)

"""Contract tests of the policy registry: staging, checksums, ACKs, atomic publish, leases."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from closedloop.contracts import PolicyManifest, SamplerConfig, sha256_hex
from closedloop.policy.registry import (
    ChecksumMismatchError,
    MissingAckError,
    PolicyRegistry,
    RegistryError,
    UnknownVersionError,
    combine_checksums,
    state_dict_checksum,
    version_index,
    version_name,
)
from closedloop.policy.weights import tensor_digests

H = sha256_hex("x")


def template(**kw: object) -> PolicyManifest:
    values: dict[str, object] = dict(
        policy_version="v0000", weight_checksum=H, tokenizer_revision=H, system_prompt_hash=H,
        chat_template_hash=H, tool_schema_hash=H, parser_version="action-parser-v1",
        memory_policy="full_history", compactor_version=None, retry_budget=0, step_budget=8,
        max_action_tokens=64, sampler=SamplerConfig())
    values.update(kw)
    return PolicyManifest(**values)  # type: ignore[arg-type]


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(4, 3, generator=g),
            "layer.bias": torch.randn(4, generator=g),
            "emb": torch.randn(5, 2, generator=g).to(torch.bfloat16),
            "count": torch.tensor(seed)}


@pytest.fixture
def reg(tmp_path: Path) -> PolicyRegistry:
    return PolicyRegistry(tmp_path / "registry")


def test_version_names() -> None:
    assert version_name(3) == "v0003" and version_index("v0003") == 3
    assert version_index(version_name(12345)) == 12345
    for bad in ("3", "v03", "V0003", "v0003a", ""):
        with pytest.raises(RegistryError):
            version_index(bad)
    with pytest.raises(RegistryError):
        version_name(-1)


def test_checksum_is_canonical_and_sensitive() -> None:
    sd = weights(0)
    c = state_dict_checksum(sd)
    assert c.startswith("sha256:") and len(c) == 71
    assert state_dict_checksum(dict(reversed(list(sd.items())))) == c  # order-free
    flipped = {**sd, "layer.bias": sd["layer.bias"].clone()}
    flipped["layer.bias"].view(torch.int32)[0] ^= 1  # one bit
    assert state_dict_checksum(flipped) != c
    assert state_dict_checksum({**sd, "count": sd["count"].to(torch.int32)}) != c
    assert state_dict_checksum({**sd, "layer.bias": sd["layer.bias"].reshape(2, 2)}) != c
    renamed = {("x" if k == "emb" else k): v for k, v in sd.items()}
    assert state_dict_checksum(renamed) != c
    noncontig = {**sd, "layer.weight": sd["layer.weight"].t().contiguous().t()}
    assert not noncontig["layer.weight"].is_contiguous()
    assert state_dict_checksum(noncontig) == c


def test_stage_writes_verified_immutable_version(reg: PolicyRegistry) -> None:
    staged = reg.stage(weights(0), template())
    assert staged.version == "v0000" and reg.versions() == ["v0000"]
    assert staged.manifest.weight_checksum == staged.checksum == state_dict_checksum(weights(0))
    assert staged.manifest.policy_version == "v0000"
    assert sorted(p.name for p in staged.path.iterdir()) == [
        "checksum", "digests.json", "manifest.json", "weights.safetensors"]
    assert reg.tensor_digests("v0000") == tensor_digests(weights(0))
    assert reg.manifest("v0000") == staged.manifest
    assert list((reg.root / "staging").iterdir()) == []
    loaded = reg.load_state_dict("v0000")
    assert all(torch.equal(loaded[k], v) for k, v in weights(0).items())
    assert reg.stage(weights(1), template()).version == "v0001"
    with pytest.raises(RegistryError):
        reg.stage(weights(2), template(), version="v0001")
    assert reg.verify("v0001") == state_dict_checksum(weights(1))
    with pytest.raises(UnknownVersionError):
        reg.load_state_dict("v0007")


def test_tied_tensors_are_stored(reg: PolicyRegistry) -> None:
    emb = torch.randn(6, 2)
    staged = reg.stage({"embed.weight": emb, "lm_head.weight": emb}, template())
    loaded = reg.load_state_dict(staged.version)
    assert torch.equal(loaded["embed.weight"], loaded["lm_head.weight"])


def test_corrupt_version_is_refused(reg: PolicyRegistry) -> None:
    reg.publish(reg.stage(weights(0), template()).version)
    bad = reg.stage(weights(1), template())
    path = bad.path / "weights.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError):
        reg.load_state_dict(bad.version)
    with pytest.raises(ChecksumMismatchError):
        reg.publish(bad.version)
    assert reg.active().version == "v0000"  # type: ignore[union-attr]
    path.write_bytes(b"garbage")
    with pytest.raises(ChecksumMismatchError):
        reg.verify(bad.version)


@pytest.mark.parametrize("damage", ["weights", "checksum", "digests", "manifest", "extra"])
def test_a_version_changed_after_staging_fails_verify_in_the_stager_and_elsewhere(
        reg: PolicyRegistry, damage: str) -> None:
    """The stager's verify (its own files' hashes) refuses what a full verify refuses: any
    staged file changed by one byte, or a second weights file beside them."""
    version = reg.stage(weights(0), template()).version
    other = PolicyRegistry(reg.root)  # another process's view: the full verify
    assert reg.verify(version) == other.verify(version)
    folder = reg.path(version)
    if damage == "extra":
        (folder / "adapter.safetensors").write_bytes((folder / "weights.safetensors")
                                                     .read_bytes())
    else:
        name = {"weights": "weights.safetensors", "checksum": "checksum",
                "digests": "digests.json", "manifest": "manifest.json"}[damage]
        raw = bytearray((folder / name).read_bytes())
        raw[len(raw) // 2] ^= 0x01
        (folder / name).write_bytes(bytes(raw))
    for view in (reg, other):
        with pytest.raises(RegistryError):
            view.verify(version)
    with pytest.raises(RegistryError):
        reg.publish(version)
    assert reg.active() is None


def test_prepared_weights_stage_the_same_version_and_reads_check_the_bytes(
        tmp_path: Path) -> None:
    """A version staged from ``prepare_weights`` is byte for byte the one staged from the
    tensors; until it is published its stager reads it back against the bytes it wrote (a
    changed file refused, naming it), then in full like any other reader."""
    from closedloop.policy.registry import prepare_weights

    a, b = PolicyRegistry(tmp_path / "a"), PolicyRegistry(tmp_path / "b")
    state = weights(3)
    prepared = prepare_weights(state)
    va, vb = a.stage(state, template()), b.stage(prepared, template())
    for name in ("weights.safetensors", "manifest.json", "checksum", "digests.json"):
        assert (va.path / name).read_bytes() == (vb.path / name).read_bytes()
    assert prepared.checksum == va.checksum and prepared.digests == a.tensor_digests(va.version)
    loaded = b.load_state_dict(vb.version)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    path = vb.path / "weights.safetensors"
    good = path.read_bytes()
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(ChecksumMismatchError, match=r"weights\.safetensors: not the file staged"):
        b.load_state_dict(vb.version)
    path.write_bytes(good)
    b.publish(vb.version)
    assert b._written == {}  # published: its bytes are let go, reads verify in full
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(ChecksumMismatchError, match="weights checksum"):
        b.load_state_dict(vb.version)


def test_damaged_registry_files_are_registry_errors_naming_the_file(
        reg: PolicyRegistry) -> None:
    version = reg.stage(weights(0), template()).version
    reg.publish(version)
    folder = reg.path(version)
    (reg.root / "ACTIVE").write_text('{"version": ')
    with pytest.raises(RegistryError, match="ACTIVE: cannot be read as JSON"):
        reg.active()
    (reg.root / "ACTIVE").write_text('{"version": "v0000"}')
    with pytest.raises(RegistryError, match="not an ACTIVE pointer"):
        reg.active()
    (folder / "checksum").unlink()
    with pytest.raises(ChecksumMismatchError, match="checksum: cannot be read"):
        reg.verify(version)
    (folder / "manifest.json").write_text('{"policy_version": "v0000"}')
    with pytest.raises(RegistryError, match=r"manifest\.json: not a policy manifest"):
        reg.manifest(version)
    with open(reg.root / "publish_log.jsonl", "a") as fh:
        fh.write("{torn")
    with pytest.raises(RegistryError, match=r"publish_log\.jsonl:2: not valid JSON"):
        reg.history()


def test_publish_requires_matching_worker_acks(reg: PolicyRegistry) -> None:
    assert reg.active() is None
    with pytest.raises(RegistryError):
        reg.lease_for_episode()
    v0 = reg.stage(weights(0), template())
    reg.publish(v0.version)
    v1 = reg.stage(weights(1), template())
    reg.ack("gen-0", v1.version, v1.manifest.weight_checksum)
    with pytest.raises(MissingAckError):
        reg.publish(v1.version, require_acks_from=["gen-0", "gen-1"])
    reg.ack("gen-1", v1.version, v0.checksum)  # loaded the wrong weights
    with pytest.raises(ChecksumMismatchError, match="gen-1"):
        reg.publish(v1.version, require_acks_from=["gen-0", "gen-1"])
    assert reg.active().version == "v0000"  # type: ignore[union-attr]
    reg.ack("gen-1", v1.version, v1.checksum)  # reload fixed it
    published = reg.publish(v1.version, require_acks_from=["gen-0", "gen-1"])
    assert published.version == reg.active().version == "v0001"  # type: ignore[union-attr]
    assert [h["version"] for h in reg.history()] == ["v0000", "v0001"]
    with pytest.raises(RegistryError):
        reg.ack("../evil", v1.version, v1.checksum)


def test_publication_keeps_open_episode_lease_on_old_version(reg: PolicyRegistry) -> None:
    reg.publish(reg.stage(weights(0), template()).version)
    old = reg.lease_for_episode()
    v1 = reg.stage(weights(1), template())
    reg.publish(v1.version)
    # finish_old: the in-flight episode still holds v0000 and its weights stay loadable.
    assert (old.version, old.checksum) == ("v0000", state_dict_checksum(weights(0)))
    sd = reg.load_state_dict(old.version)
    assert torch.equal(sd["layer.weight"], weights(0)["layer.weight"])
    new = reg.lease_for_episode()
    assert (new.version, new.checksum) == ("v0001", v1.checksum)
    assert reg.open_leases() == (old, new)
    reg.release(old)
    assert reg.open_leases() == (new,)


def test_adapter_version_is_one_policy_identity(reg: PolicyRegistry) -> None:
    adapter = {"lora_A": torch.randn(2, 4), "lora_B": torch.zeros(4, 2)}
    with pytest.raises(RegistryError):
        reg.stage(adapter, template(), kind="adapter")
    base = state_dict_checksum(weights(0))
    staged = reg.stage(adapter, template(base_weight_checksum=base), kind="adapter")
    m = staged.manifest
    assert m.adapter_checksum == staged.checksum == state_dict_checksum(adapter)
    assert m.weight_checksum == combine_checksums(base, staged.checksum) != base
    assert (staged.path / "adapter.safetensors").is_file()
    assert reg.verify(staged.version) == staged.checksum
    reg.publish(staged.version)
    assert reg.lease_for_episode().checksum == m.weight_checksum


def test_partial_staging_leftovers_are_ignored(reg: PolicyRegistry) -> None:
    junk = reg.root / "staging" / "v0000-crashed"
    junk.mkdir()
    (junk / "weights.safetensors").write_bytes(b"half")
    assert reg.versions() == []
    assert reg.stage(weights(0), template()).version == "v0000"
    assert not junk.exists()


def test_readers_never_see_a_partial_active_pointer(reg: PolicyRegistry) -> None:
    versions = [reg.stage(weights(i), template()).version for i in range(2)]
    reg.publish(versions[0])
    seen: set[str] = set()
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            try:
                pointer = json.loads((reg.root / "ACTIVE").read_text())
                seen.add(reg.active().version)  # type: ignore[union-attr]
                assert pointer["version"] in versions
            except BaseException as exc:
                errors.append(exc)
                return

    t = threading.Thread(target=reader)
    t.start()
    for i in range(40):
        reg.publish(versions[i % 2])
    stop.set()
    t.join()
    assert errors == [] and seen <= set(versions)


def _child_publish_forever(root: str) -> None:
    """Stage and publish ~8 MB versions in a loop until killed."""
    reg = PolicyRegistry(root)
    print("ready", flush=True)
    for _ in range(10_000):
        existing = reg.versions()
        index = version_index(existing[-1]) + 1 if existing else 0
        staged = reg.stage({"w": torch.full((2_000_000,), float(index))}, template(),
                           version=version_name(index))
        reg.ack("gen-0", staged.version, staged.checksum)
        reg.publish(staged.version, require_acks_from=["gen-0"])


@pytest.mark.slow
def test_sigkill_during_stage_or_publish_leaves_only_verified_versions(tmp_path: Path) -> None:
    import random
    import signal
    import subprocess
    import sys

    rng = random.Random(7)
    root = tmp_path / "registry"
    for _ in range(3):
        with subprocess.Popen([sys.executable, __file__, str(root)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) as proc:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
            try:
                proc.wait(timeout=rng.uniform(0.2, 0.8))
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == -signal.SIGKILL, err
        reg = PolicyRegistry(root)
        for version in reg.versions():  # every visible version is complete and verified
            assert reg.verify(version) == reg.manifest(version).weight_checksum
        active = reg.active()
        if active is not None:
            w = reg.load_state_dict(active.version)["w"]
            assert torch.all(w == float(version_index(active.version)))
            assert active.version in reg.versions()


if __name__ == "__main__":
    import sys

    _child_publish_forever(sys.argv[1])

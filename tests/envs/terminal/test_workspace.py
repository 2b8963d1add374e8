"""Workspace paths, the file tree, the state hash and the exported-state codec."""

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from closedloop.contracts import Termination
from closedloop.envs import StateDecodeError, WorkspacePathError
from closedloop.envs.terminal import WorkspaceLimits, decode_state
from closedloop.envs.terminal.workspace import FileTree, draw_seed, new_state, normalize_path
from closedloop.errors import WorkspaceLimitError

LIMITS = WorkspaceLimits(max_file_bytes=100, max_total_bytes=250, max_files=4)


@pytest.mark.parametrize("raw,norm", [
    ("a.txt", "a.txt"), ("./a.txt", "a.txt"), ("d/./e.py", "d/e.py"), ("d/e/f", "d/e/f"),
])
def test_normalize_accepts(raw, norm):
    assert normalize_path(raw) == norm


@pytest.mark.parametrize("raw,code,violation", [
    ("/etc/passwd", "path_denied", "path_escape"),
    ("../x", "path_denied", "path_escape"),
    ("a/../../x", "path_denied", "path_escape"),
    ("a/..", "path_denied", "path_escape"),
    (".grader/answer.json", "path_denied", "reserved_path"),
    (".GRADER/answer.json", "path_denied", "reserved_path"),
    (".closedloop", "path_denied", "reserved_path"),
    ("a//b", "bad_arguments", None),
    ("a\\b", "bad_arguments", None),
    ("a\x00b", "bad_arguments", None),
    ("a\nb", "bad_arguments", None),
    ("", "bad_arguments", None),
    (".", "bad_arguments", None),
    (5, "bad_arguments", None),
    ("x" * 300, "bad_arguments", None),
])
def test_normalize_rejects(raw, code, violation):
    with pytest.raises(WorkspacePathError) as info:
        normalize_path(raw)
    assert (info.value.code, info.value.violation) == (code, violation)


def test_root_only_when_allowed():
    assert normalize_path(".", allow_root=True) == ""
    assert normalize_path("sub/", allow_root=True) == "sub"
    with pytest.raises(WorkspacePathError):
        normalize_path("sub/")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab./\\\x00.-_~", max_size=20))
def test_normalized_paths_stay_inside(raw):
    try:
        norm = normalize_path(raw)
    except WorkspacePathError:
        return
    segs = norm.split("/")
    assert not norm.startswith("/") and ".." not in segs and "" not in segs and "." not in segs
    assert normalize_path(norm) == norm


def test_file_tree_limits_and_sharing():
    tree = FileTree({"a.txt": "x" * 100}, LIMITS)
    with pytest.raises(WorkspaceLimitError):
        tree.with_file("b.txt", "y" * 101, LIMITS)
    with pytest.raises(WorkspaceLimitError):
        tree.with_file("b.txt", "y" * 100, LIMITS).with_file("c.txt", "z" * 51, LIMITS)
    t2 = tree.with_file("b.txt", "é", LIMITS)
    assert t2.size("b.txt") == 2 and t2.total_bytes == 102
    assert "b.txt" not in tree, "with_file must not change the original tree"
    assert t2.is_dir("") and not t2.is_dir("a.txt")
    with pytest.raises(WorkspacePathError):
        FileTree({"a": "1", "a/b": "2"})
    with pytest.raises(WorkspacePathError):
        FileTree({"a/../b": "1"})
    deep = FileTree({"d/e/f.txt": "1"})
    assert deep.is_dir("d") and deep.is_dir("d/e") and not deep.is_dir("d/e/f.txt")
    for clash in ("d", "d/e", "d/e/f.txt/g"):
        with pytest.raises(WorkspacePathError):
            deep.with_file(clash, "x", LIMITS)
    assert deep.with_file("d/e/f.txt", "2", LIMITS)["d/e/f.txt"] == "2"


def _state(files=None):
    return new_state("terminal-repair-v1", "task/1", 3, 10, FileTree(files or {"a.txt": "hi\n"}))


def test_state_hash_covers_every_component():
    base = _state()
    variants = [
        dataclasses.replace(base, files=FileTree({"a.txt": "hi!\n"})),
        dataclasses.replace(base, clock=1),
        draw_seed(base)[1],
        dataclasses.replace(base, steps=1),
        dataclasses.replace(base, counters=dataclasses.replace(base.counters, tool_calls=1)),
        dataclasses.replace(base, done=True, termination=Termination.AGENT_FINISH),
        _state({"a.txt": "hi\n", "b": ""}),
        new_state("terminal-repair-v1", "task/1", 4, 10, FileTree({"a.txt": "hi\n"})),
    ]
    hashes = {base.state_hash} | {v.state_hash for v in variants}
    assert len(hashes) == len(variants) + 1
    assert _state().state_hash == base.state_hash


def test_draw_seed_is_deterministic_and_advances():
    base = _state()
    v1, s1 = draw_seed(base)
    v2, s2 = draw_seed(base)
    assert (v1, s1.rng_hash) == (v2, s2.rng_hash)
    assert s1.rng_hash != base.rng_hash
    assert draw_seed(s1)[0] != v1


def test_export_roundtrip():
    state = draw_seed(_state({"a.txt": "hi\n", "d/ü.txt": "ünïcode\n"}))[1]
    data = state.to_bytes()
    back = decode_state(data)
    assert back == state
    assert back.state_hash == state.state_hash and back.to_bytes() == data


@pytest.mark.parametrize("mutate", [
    lambda d: d.update(clock=d["clock"] + 1),
    lambda d: d["files"].update({"a.txt": "changed"}),
    lambda d: d["rng_state"][1].__setitem__(0, d["rng_state"][1][0] ^ 1),
    lambda d: d["counters"].update(tool_calls=7),
    lambda d: d.update(done=True),
    lambda d: d.pop("steps"),
    lambda d: d.update(steps="1"),
    lambda d: d.update(termination="bogus"),
    lambda d: d["files"].update({"../x": "1"}),
    lambda d: d.update(rng_state=[3, [1, 2], None]),
    lambda d: d["counters"]["log"].append({"step": 1}),
])
def test_decode_rejects_corruption(mutate):
    data = json.loads(_state().to_bytes())
    mutate(data)
    with pytest.raises(StateDecodeError):
        decode_state(json.dumps(data).encode())


@pytest.mark.parametrize("data", [b"", b"\xff", b"[]", b"{}", b"nul", "x"])
def test_decode_rejects_garbage(data):
    with pytest.raises(StateDecodeError):
        decode_state(data)

"""The terminal-repair tools: ``list_dir``, ``read_file``, ``write_file``, ``replace``, ``run``.

``call_tool`` is pure: it reads a ``WorkspaceState`` and returns a ``ToolOutcome`` (observation,
error code, new files, violations); the environment applies it. A tool that fails returns the
structured observation ``{"error": {"code": ..., "message": ...}}`` and no new files, so an
invalid call changes nothing but the step counter, clock and counters.

Error codes: ``unknown_tool``, ``tool_not_allowed``, ``bad_arguments``, ``path_denied``,
``not_found``, ``not_a_directory``, ``is_a_directory``, ``ambiguous_match``, ``count_mismatch``,
``limit_exceeded``, ``command_not_allowed``, ``tool_timeout``. Policy violations (counted for
the verifier): ``path_escape`` and ``reserved_path`` (denied paths), ``tool_not_allowed``,
``command_not_allowed``, and ``sandbox_<kind>`` for each refusal inside a command.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from closedloop.contracts import Action, canonical_json
from closedloop.envs.task_records import TaskSpec
from closedloop.envs.terminal.sandbox import SandboxConfig, run_command, truncation_label
from closedloop.envs.terminal.workspace import (
    RESERVED_PREFIXES,
    FileTree,
    WorkspaceLimits,
    WorkspaceState,
    bounded,
    normalize_path,
)
from closedloop.errors import ToolFailure, WorkspaceLimitError, WorkspacePathError

MAX_RUN_ARGS = 32
MAX_ARG_CHARS = 1024


@dataclass(frozen=True)
class ToolContext:
    """What the tools may consult besides the state: the public task spec and the limits."""

    spec: TaskSpec
    limits: WorkspaceLimits = field(default_factory=WorkspaceLimits)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    read_cap_bytes: int = 8192


@dataclass(frozen=True)
class ToolOutcome:
    """The result of one tool call.

    files: the new workspace when the call changed it, else ``None``; violations: (code,
    detail) pairs to record; command_ran: a ``run`` executed (the env then keeps the RNG draw);
    timed_out: the command was killed at its limit.
    """

    observation: str
    error: str | None = None
    files: FileTree | None = None
    violations: tuple[tuple[str, str], ...] = ()
    command_ran: bool = False
    timed_out: bool = False


def error_observation(code: str, message: str) -> str:
    """Return the canonical structured error observation."""
    return canonical_json({"error": {"code": code, "message": message}})


@dataclass(frozen=True)
class Param:
    """One tool argument: JSON type name, whether required, default, description."""

    name: str
    type: str
    required: bool
    default: Any = None
    description: str = ""


@dataclass(frozen=True)
class ToolSpec:
    """A tool: its name, description, parameters and implementation."""

    name: str
    description: str
    params: tuple[Param, ...]
    fn: Callable[[dict[str, Any], WorkspaceState, ToolContext, int], ToolOutcome]


_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,),
                                            "array": (list,)}


def _unencodable(value: Any) -> bool:
    """Whether ``value`` holds a string (or object key) that UTF-8 cannot encode: a lone
    surrogate, which JSON's ``\\udXXX`` escapes produce from pure-ASCII action text."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, list | tuple):
        return any(_unencodable(v) for v in value)
    if isinstance(value, Mapping):
        return any(_unencodable(k) or _unencodable(v) for k, v in value.items())
    return False


def _bind(tool: ToolSpec, args: Mapping[str, Any]) -> dict[str, Any]:
    """Check the arguments against the tool's parameters; ``bad_arguments`` on any mismatch.

    Every string (keys and nested values included) must be encodable text: this runs before
    the tool looks at the state, so such a call changes nothing but the step counters.
    """
    bad = sorted(repr(k) for k, v in args.items() if _unencodable(k) or _unencodable(v))
    if bad:
        raise ToolFailure("bad_arguments", f"{tool.name}: argument {bad[0]} holds text that "
                          "is not valid Unicode (a lone surrogate)")
    known = {p.name for p in tool.params}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ToolFailure("bad_arguments", f"{tool.name}: unknown arguments {unknown}")
    bound: dict[str, Any] = {}
    for p in tool.params:
        if p.name not in args:
            if p.required:
                raise ToolFailure("bad_arguments", f"{tool.name}: missing argument {p.name!r}")
            bound[p.name] = p.default
            continue
        value = args[p.name]
        if isinstance(value, bool) or not isinstance(value, _JSON_TYPES[p.type]):
            raise ToolFailure("bad_arguments", f"{tool.name}: {p.name!r} must be a {p.type}")
        bound[p.name] = value
    return bound


def _path(value: str, *, allow_root: bool = False) -> str:
    try:
        return normalize_path(value, allow_root=allow_root)
    except WorkspacePathError as exc:
        raise ToolFailure(exc.code, f"{bounded(repr(value))}: {exc.reason}",
                          exc.violation) from None


def _list_dir(args: dict[str, Any], state: WorkspaceState, ctx: ToolContext,
              seed: int) -> ToolOutcome:
    path = _path(args["path"], allow_root=True)
    files = state.files
    if path in files:
        raise ToolFailure("not_a_directory", f"{path!r} is a file")
    if not files.is_dir(path):
        raise ToolFailure("not_found", f"no directory {path or '.'!r}")
    prefix = path + "/" if path else ""
    entries: dict[str, str] = {}
    for p in files:
        if p.startswith(prefix):
            head, sep, _ = p[len(prefix):].partition("/")
            entries[head + "/" if sep else head] = "" if sep else f"{files.size(p)} bytes"
    lines = [f"{name}  {info}".rstrip() for name, info in sorted(entries.items())]
    return ToolOutcome(f"{path or '.'}/ ({len(lines)} entries)\n" + "\n".join(lines))


def _existing_file(state: WorkspaceState, raw: str) -> str:
    path = _path(raw)
    if path not in state.files:
        if state.files.is_dir(path):
            raise ToolFailure("is_a_directory", f"{path!r} is a directory")
        raise ToolFailure("not_found", f"no file {path!r}")
    return path


def cap_text(text: str, cap: int) -> str:
    """Cut ``text`` to at most ``cap`` UTF-8 bytes (whole characters) plus the label if cut."""
    data = text.encode("utf-8")
    if len(data) <= cap:
        return text
    head = data[:cap].decode("utf-8", errors="ignore")
    return head + ("" if head.endswith("\n") else "\n") + truncation_label(cap)


def _read_file(args: dict[str, Any], state: WorkspaceState, ctx: ToolContext,
               seed: int) -> ToolOutcome:
    path = _existing_file(state, args["path"])
    return ToolOutcome(cap_text(state.files[path], ctx.read_cap_bytes))


def _writable(state: WorkspaceState, raw: str) -> str:
    path = _path(raw)
    if state.files.is_dir(path):
        raise ToolFailure("is_a_directory", f"{path!r} is a directory")
    parts = path.split("/")
    for i in range(1, len(parts)):
        if "/".join(parts[:i]) in state.files:
            raise ToolFailure("not_a_directory", f"{'/'.join(parts[:i])!r} is a file")
    return path


def _store(state: WorkspaceState, ctx: ToolContext, path: str, text: str) -> FileTree:
    try:
        return state.files.with_file(path, text, ctx.limits)
    except WorkspaceLimitError as exc:
        raise ToolFailure("limit_exceeded", str(exc)) from None
    except WorkspacePathError as exc:
        raise ToolFailure(exc.code, exc.reason, exc.violation) from None


def _write_file(args: dict[str, Any], state: WorkspaceState, ctx: ToolContext,
                seed: int) -> ToolOutcome:
    path = _writable(state, args["path"])
    files = _store(state, ctx, path, args["content"])
    return ToolOutcome(f"wrote {files.size(path)} bytes to {path}", files=files)


def _replace(args: dict[str, Any], state: WorkspaceState, ctx: ToolContext,
             seed: int) -> ToolOutcome:
    path = _existing_file(state, args["path"])
    old, new, count = args["old"], args["new"], args["count"]
    if old == "":
        raise ToolFailure("bad_arguments", "replace: 'old' must not be empty")
    if count < 1:
        raise ToolFailure("bad_arguments", "replace: 'count' must be >= 1")
    text = state.files[path]
    found = text.count(old)
    if found == 0:
        raise ToolFailure("not_found", f"'old' does not occur in {path!r}")
    if found != count:
        code = "ambiguous_match" if count == 1 else "count_mismatch"
        raise ToolFailure(code, f"'old' occurs {found} times in {path!r}, expected {count}")
    files = _store(state, ctx, path, text.replace(old, new))
    return ToolOutcome(f"replaced {found} occurrence{'s' if found > 1 else ''} in {path}",
                       files=files)


def _check_run_arg(arg: Any) -> str:
    if not isinstance(arg, str):
        raise ToolFailure("bad_arguments", "run: every arg must be a string")
    if len(arg) > MAX_ARG_CHARS or any(ord(c) < 32 or ord(c) == 127 for c in arg):
        raise ToolFailure("bad_arguments", "run: arg too long or holds control characters")
    for piece in (arg, *arg.split("=", 1)[1:]):
        segs = piece.split("/")
        if piece.startswith("/") or ".." in segs:
            raise ToolFailure("path_denied", f"run: arg {bounded(repr(arg))} leaves the "
                              "workspace", "path_escape")
        if any(s.lower() in RESERVED_PREFIXES for s in segs):
            raise ToolFailure("path_denied", f"run: arg {bounded(repr(arg))} names a reserved "
                              "path", "reserved_path")
    return arg


def _run(args: dict[str, Any], state: WorkspaceState, ctx: ToolContext,
         seed: int) -> ToolOutcome:
    name = args["command"]
    if name not in ctx.spec.commands:
        raise ToolFailure("command_not_allowed", f"command {bounded(repr(name))} is not in the "
                          f"allowlist {sorted(ctx.spec.commands)}", "command_not_allowed")
    extra = args["args"]
    if len(extra) > MAX_RUN_ARGS:
        raise ToolFailure("bad_arguments", f"run: more than {MAX_RUN_ARGS} args")
    argv = (*ctx.spec.commands[name], *(_check_run_arg(a) for a in extra))
    result = run_command(argv, state.files, env_seed=seed, clock=state.clock,
                         config=ctx.sandbox, limits=ctx.limits)
    violations = tuple((f"sandbox_{r.split(':', 1)[0]}", bounded(r)) for r in result.refusals)
    if result.timed_out:
        return ToolOutcome(error_observation("tool_timeout", f"command {name!r} exceeded its "
                                             f"limit ({ctx.sandbox.timeout_s:g} s) and was "
                                             "killed; its writes were discarded"),
                           error="tool_timeout", violations=violations, command_ran=True,
                           timed_out=True)
    return ToolOutcome(_render_run(name, extra, result.exit_code, result.stdout, result.stderr,
                                   result.rejected),
                       files=result.files_after, violations=violations, command_ran=True)


def _render_run(name: str, extra: list[str], code: int, stdout: str, stderr: str,
                rejected: tuple[tuple[str, str], ...]) -> str:
    head = " ".join([name, *extra])
    parts = [f"$ run {head}", f"exit code: {code}", "--- stdout ---", stdout,
             "--- stderr ---", stderr]
    if rejected:
        parts.append("--- files not kept ---")
        parts.extend(f"{p}: {why}" for p, why in rejected)
    return "\n".join(parts)


TOOLS: dict[str, ToolSpec] = {t.name: t for t in (
    ToolSpec("list_dir", "List the files and directories under a workspace directory.",
             (Param("path", "string", False, ".", "directory, default the workspace root"),),
             _list_dir),
    ToolSpec("read_file", "Return a file's text (long files are truncated with a label).",
             (Param("path", "string", True, description="file path"),), _read_file),
    ToolSpec("write_file", "Create or overwrite a file with the given text.",
             (Param("path", "string", True, description="file path"),
              Param("content", "string", True, description="the whole new text")),
             _write_file),
    ToolSpec("replace", "Replace text in a file. 'old' must occur exactly 'count' times "
             "(default 1); all occurrences are replaced.",
             (Param("path", "string", True, description="file path"),
              Param("old", "string", True, description="exact text to find (non-empty)"),
              Param("new", "string", True, description="replacement text"),
              Param("count", "integer", False, 1, "expected number of occurrences")),
             _replace),
    ToolSpec("run", "Run an allowlisted command in a sandbox over the workspace.",
             (Param("command", "string", True, description="a command name from the task"),
              Param("args", "array", False, (), "extra string arguments")),
             _run),
)}


def call_tool(action: Action, state: WorkspaceState, ctx: ToolContext,
              seed: int = 0) -> ToolOutcome:
    """Execute a tool action against ``state``; never raises for agent mistakes.

    ``seed`` is the value the env drew from its RNG for a ``run`` (kept only if the command ran).
    Sandbox infrastructure failures propagate as ``SandboxInfraError``.
    """
    tool = TOOLS.get(action.name)
    try:
        if tool is None:
            raise ToolFailure("unknown_tool", f"no tool named {action.name!r}; tools: "
                              f"{sorted(ctx.spec.allowed_tools)}")
        if action.name not in ctx.spec.allowed_tools:
            raise ToolFailure("tool_not_allowed", f"tool {action.name!r} is not allowed in "
                              "this task", "tool_not_allowed")
        args = _bind(tool, action.args)
        if tool.name == "run":
            args["args"] = list(args["args"])
        return tool.fn(args, state, ctx, seed)
    except ToolFailure as exc:
        violations = ((exc.violation, bounded(exc.message)),) if exc.violation else ()
        return ToolOutcome(error_observation(exc.code, exc.message), error=exc.code,
                           violations=violations)


def tool_schemas(spec: TaskSpec) -> list[dict[str, Any]]:
    """Return JSON schemas of the task's allowed tools (for prompts and the manifest hash)."""
    out = []
    for name in sorted(spec.allowed_tools):
        tool = TOOLS.get(name)
        if tool is None:
            continue
        props: dict[str, Any] = {}
        for p in tool.params:
            prop: dict[str, Any] = {"type": p.type, "description": p.description}
            if p.type == "array":
                prop["items"] = {"type": "string"}
            if tool.name == "run" and p.name == "command":
                prop["enum"] = sorted(spec.commands)
            props[p.name] = prop
        out.append({"name": tool.name, "description": tool.description,
                    "parameters": {"type": "object", "properties": props,
                                   "required": [p.name for p in tool.params if p.required]}})
    return out

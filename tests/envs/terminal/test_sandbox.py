"""The sandbox: real execution, determinism, caps, and every refusal the audit hook owes."""

import os
import time
import types
from pathlib import Path

import pytest

import closedloop.envs.task_records as task_module
from closedloop.envs import SandboxCommandError
from closedloop.envs.terminal import WorkspaceLimits, run_command
from closedloop.envs.terminal.sandbox import SandboxConfig, check_argv, execute, read_back

CFG = SandboxConfig(timeout_s=5.0, output_cap_bytes=4096)


def run(src, *args, files=None, **kw):
    all_files = {"prog.py": src, **(files or {})}
    return run_command(("python3", "prog.py", *args), all_files, config=CFG, **kw)


def assert_refused(result, kind, fragment=""):
    assert result.exit_code == 1, result
    assert f"sandbox: {kind} refused" in result.stderr, result.stderr
    assert any(r.startswith(f"{kind}:") and fragment in r for r in result.refusals), result


def test_runs_for_real_and_reads_writes_back():
    src = ("import sys, os\nprint('args', sys.argv[1:])\nopen('new/out.txt','w').write('hi')\n"
           "os.remove('gone.txt')\n")
    r = run(src.replace("new/", ""), "a", "b", files={"gone.txt": "x", "keep.txt": "k"})
    assert r.exit_code == 0 and not r.timed_out and not r.truncated
    assert r.stdout == "args ['a', 'b']\n"
    assert dict(r.files_after) == {"prog.py": src.replace("new/", ""), "out.txt": "hi",
                                   "keep.txt": "k"}


def test_same_inputs_same_outputs():
    src = ("import os, random\nprint(hash('abc'), random.random(), os.environ['CLOSEDLOOP_SEED'],"
           " os.environ['CLOSEDLOOP_CLOCK'], os.getcwd())\n"
           "open('r.txt','w').write(str(set('abcdef')))\nraise ValueError('boom')\n")
    a = run(src, env_seed=5, clock=3)
    b = run(src, env_seed=5, clock=3)
    c = run(src, env_seed=6, clock=3)
    assert (a.stdout, a.stderr, dict(a.files_after)) == (b.stdout, b.stderr, dict(b.files_after))
    assert a.stdout.split()[2:] == ["5", "3", "/sandbox/ws"]
    assert c.stdout != a.stdout
    assert "ValueError: boom" in a.stderr and "<sandbox>" not in a.stderr
    assert "closedloop-sbx" not in a.stderr + a.stdout


def test_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    r = run("import os\nprint(sorted(os.environ))\nprint(os.environ['HOME'])\n")
    keys = eval(r.stdout.splitlines()[0])  # our own program's repr
    assert "SECRET_TOKEN" not in keys and "VIRTUAL_ENV" not in keys
    assert "PYTHONHASHSEED" in keys and r.stdout.splitlines()[1] == "/sandbox/home"


@pytest.mark.parametrize("src,fragment", [
    ("open('../outside.txt')", "../outside.txt"),
    ("open('sub/../../outside.txt', 'w')", "outside.txt"),
    ("open('/etc/hostname')", "/etc/hostname"),
    ("import os\nos.listdir('/')", "os.listdir /"),
    ("open('/tmp/closedloop-evil.txt', 'w').write('x')", "/tmp/closedloop-evil.txt"),
    ("import os\nos.rename('prog.py', '/tmp/closedloop-evil.txt')", "os.rename"),
    ("import os\nos.chdir('/')\nopen('etc/hostname')", "/"),
    ("from pathlib import Path\nPath('/etc/hostname').read_text()", "/etc/hostname"),
    ("class P:\n    def __fspath__(self):\n        return '/etc/hostname'\nopen(P())",
     "/etc/hostname"),
])
def test_paths_outside_the_workspace_are_refused(src, fragment):
    r = run(src)
    assert_refused(r, "path", fragment)
    assert not os.path.exists("/tmp/closedloop-evil.txt")
    assert set(r.files_after) == {"prog.py"}


def test_grader_and_library_sources_are_unreadable():
    secret = Path(task_module.__file__).resolve()
    r = run("import sys\nprint(open(sys.argv[1]).read()[:50])", str(secret))
    assert_refused(r, "path", str(secret))
    r = run("import closedloop")
    assert r.exit_code == 1 and "No module named 'closedloop'" in r.stderr


def test_symlink_creation_is_refused():
    assert_refused(run("import os\nos.symlink('/etc/hostname', 'link')"), "link")
    assert_refused(run("import os\nos.link('prog.py', 'hard')"), "link")


def _crafted_root(tmp_path):
    root = tmp_path / "root"
    for sub in ("ws", "home", "tmp"):
        (root / sub).mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("top secret")
    (root / "ws" / "link.txt").symlink_to(outside / "secret.txt")
    (root / "ws" / "dirlink").symlink_to(outside)
    return root


@pytest.mark.parametrize("src", [
    "print(open('link.txt').read())",
    "print(open('dirlink/secret.txt').read())",
    "open('dirlink/new.txt', 'w').write('x')",
])
def test_planted_symlink_out_of_the_workspace_is_refused(tmp_path, src):
    root = _crafted_root(tmp_path)
    (root / "ws" / "prog.py").write_text(src)
    r = execute(("python3", "prog.py"), root, env_seed=0, clock=0, config=CFG,
                limits=WorkspaceLimits())
    assert_refused(r, "path")
    assert "top secret" not in r.stdout
    assert not (tmp_path / "outside" / "new.txt").exists()
    assert set(r.files_after) == {"prog.py"}
    assert dict(r.rejected) == {"link.txt": "symlink", "dirlink": "symlink"}


def test_read_back_never_follows_symlinks(tmp_path):
    root = _crafted_root(tmp_path)
    (root / "ws" / "ok.txt").write_text("fine")
    tree, rejected = read_back(root / "ws", WorkspaceLimits())
    assert dict(tree) == {"ok.txt": "fine"}
    assert {p for p, _ in rejected} == {"link.txt", "dirlink"}


@pytest.mark.parametrize("src,fragment", [
    ("import socket\nsocket.socket()", "socket.__new__"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)", "socket."),
    ("import socket\nsocket.getaddrinfo('example.com', 80)", "socket.getaddrinfo"),
])
def test_network_is_refused(src, fragment):
    assert_refused(run(src), "network", fragment)


@pytest.mark.parametrize("src,fragment", [
    ("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen"),
    ("import os\nos.system('true')", "os.system"),
    ("import os\nos.fork()", "os.fork"),
    ("import os\nos.execv('/bin/true', ['true'])", "os.exec"),
    ("import os\nos.posix_spawn('/bin/true', ['true'], {})", "os.posix_spawn"),
    ("import os, signal\nos.kill(1, signal.SIGTERM)", "os.kill"),
])
def test_spawning_processes_is_refused(src, fragment):
    assert_refused(run(src), "process", fragment)


def test_raw_fork_exec_is_neutralized():
    src = ("import _posixsubprocess\ntry:\n    _posixsubprocess.fork_exec()\n"
           "except PermissionError as e:\n    print('refused:', e)\n")
    assert run(src).stdout.startswith("refused: sandbox: process spawning refused")


@pytest.mark.parametrize("src,kind", [
    ("import ctypes", "import"),
    ("import gc\ngc.get_objects()", "introspection"),
    ("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))", "rlimit"),
])
def test_escape_hatches_are_refused(src, kind):
    assert_refused(run(src), kind)


def test_runaway_command_is_killed():
    started = time.monotonic()
    src = "import os\nprint(os.getpid(), flush=True)\nopen('x.txt', 'w')\nwhile True:\n    pass\n"
    r = run_command(("python3", "prog.py"), {"prog.py": src}, config=SandboxConfig(timeout_s=1.0))
    assert r.timed_out and r.exit_code < 0 and r.files_after is None
    assert time.monotonic() - started < 4.0
    with pytest.raises(ProcessLookupError):
        os.kill(int(r.stdout.split()[0]), 0)


def test_output_over_the_cap_is_truncated_with_a_label():
    r = run_command(("python3", "prog.py"), {"prog.py": "print('x' * 10000)\nprint('y')"},
                    config=SandboxConfig(output_cap_bytes=100))
    assert r.truncated and not r.timed_out and r.exit_code == 0
    assert r.stdout == "x" * 100 + "\n[... output truncated at 100 bytes ...]"


def test_files_that_cannot_be_state_are_rejected():
    src = ("import os\nopen('bin.dat','wb').write(bytes([255, 0]))\n"
           "os.makedirs('.grader')\nopen('.grader/answer.json','w').write('{}')\n"
           "open('big.txt','w').write('z' * 300)\nopen('ok.txt','w').write('ok')\n")
    r = run_command(("python3", "prog.py"), {"prog.py": src}, config=CFG,
                    limits=WorkspaceLimits(max_file_bytes=256))
    assert r.exit_code == 0, r.stderr
    assert set(r.files_after) == {"prog.py", "ok.txt"}
    assert dict(r.rejected) == {"bin.dat": "not UTF-8 text",
                                ".grader/answer.json": "path is under a reserved prefix",
                                "big.txt": "larger than 256 bytes"}


def test_module_form_runs_a_workspace_module():
    r = run_command(("python3", "-m", "pkg.tool", "x"),
                    {"pkg/__init__.py": "",
                     "pkg/tool.py": "import sys\nprint('mod', sys.argv[1:])"},
                    config=CFG)
    assert (r.exit_code, r.stdout) == (0, "mod ['x']\n"), r.stderr


@pytest.mark.parametrize("argv", [
    (), ("bash", "-c", "ls"), ("python3",), ("python3", "-c", "print(1)"),
    ("python3", "../prog.py"), ("python3", "/abs.py"), ("python3", "-m", "a b"),
    ("python3", "prog.py", "a\x00b"),
])
def test_only_python_scripts_and_modules_run(argv):
    with pytest.raises(SandboxCommandError):
        check_argv(argv)


@pytest.mark.parametrize("files,argv,code,stderr", [
    ({}, ("python3", "prog.py"), 2, "python3: can't open file 'prog.py': [Errno 2] No such file"),
    ({"prog.py": "def f(:\n"}, ("python3", "prog.py"), 1, 'File "prog.py", line 1'),
    ({}, ("python3", "-m", "nosuchmod"), 1, "No module named nosuchmod"),
    ({"prog.py": "import sys\nsys.exit('bye')"}, ("python3", "prog.py"), 1, "bye"),
])
def test_program_failures_look_like_plain_python(files, argv, code, stderr):
    r = run_command(argv, files, config=CFG)
    assert r.exit_code == code and stderr in r.stderr, r.stderr
    assert "<sandbox>" not in r.stderr


@pytest.mark.parametrize("src,kind", [
    ("import os, builtins\nos.path.realpath = lambda p: '/ok'\nbuiltins.any = lambda x: True\n"
     "os.getcwd = lambda: '/etc'\nopen('/etc/hostname')", "path"),
    ("import sys, os\nf = sys._getframe()\nwhile f is not None:\n"
     "    for k, v in list(f.f_globals.items()):\n"
     "        if isinstance(v, (dict, set, list)) and k not in ('__builtins__', 'sys'):\n"
     "            try:\n                v.clear()\n            except Exception:\n"
     "                pass\n    f = f.f_back\nos.system('true')", "process"),
])
def test_the_hook_cannot_be_blinded_from_inside(src, kind):
    assert_refused(run(src), kind)


# a program that reaches the hook's frame through the traceback of a refused event tries to
# blind the functions the hook captured (their defaults hold every primitive it calls)
BLIND_THE_HOOK = """import os
try:
    os.system('true')
except PermissionError as exc:
    tb = exc.__traceback__
    while tb is not None:
        for value in list(tb.tb_frame.f_locals.values()):
            if callable(value) and getattr(value, '__defaults__', None):
                value.__defaults__ = tuple(None for _ in value.__defaults__)
        tb = tb.tb_next
os.system('true')
"""


def test_the_hook_functions_cannot_be_rebound_from_a_traceback():
    assert_refused(run(BLIND_THE_HOOK), "setattr", "__defaults__")


def test_a_programs_own_functions_may_set_their_defaults():
    src = ("def f(a=1):\n    return a\nf.__defaults__ = (2,)\nf.__kwdefaults__ = None\n"
           "g = lambda: 3\nf.__code__ = g.__code__\nprint(f())\n")
    r = run(src)
    assert (r.exit_code, r.stdout) == (0, "3\n"), r.stderr


def test_hook_functions_hold_no_mutable_closures():
    from closedloop.envs.terminal.sandbox_child import _make_hook

    hook = _make_hook(99, ("/w",), ("/w", "/r"), ())
    seen = [hook]
    for fn in seen:
        assert fn.__code__.co_freevars == (), fn.__name__
        for value in fn.__defaults__ or ():
            assert not isinstance(value, dict | list | set), (fn.__name__, value)
            if isinstance(value, types.FunctionType) and value not in seen:
                seen.append(value)
    assert {f.__name__ for f in seen} == {"hook", "check_path", "resolve", "deny"}

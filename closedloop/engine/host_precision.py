"""The precision policy: which matmul precision a run uses, decided once from the host.

A run asks for ``auto`` (the default), ``float32`` or ``bfloat16`` (``training.precision``);
:func:`resolve_precision` turns the request into one of ``PRECISIONS`` with the reason, and the
run applies that one value to every matmul path (warm start, SFT-only control, generator,
trainer, scoring, evaluation, audit). The rule:

- ``float32``: float32, whatever the host.
- ``auto``: ``bfloat16`` where the host multiplies bf16 natively, else ``float32``. On x86 the
  CPU flags decide: ``amx_bf16`` or ``avx512_bf16`` (the instructions oneDNN's bf16 GEMMs run
  on). An x86 CPU without them emulates bf16 through float32 conversions: a 1024² bf16 matmul
  has been measured at 0.9 GFLOP/s against 111 in float32 on an AVX2 host, 120x slower. On
  other architectures (an ARM CPU with ``bf16`` in its features, or a host whose flags cannot
  be read) the flags cannot say which kernels this torch build uses, so a short measured race
  decides: bf16 is chosen when it multiplies at least ``RACE_MARGIN`` times faster.
- ``bfloat16``: bfloat16 even where it is emulated; the race then measures the slowdown, and an
  ``EmulatedBf16Warning`` names it before the first step.

On a CUDA device (``device="cuda"``, ``closedloop.engine.device``) the GPU decides instead of
the CPU flags: ``auto`` is ``bfloat16`` where ``torch.cuda.is_bf16_supported()`` (Ampere and
later: native bf16 tensor cores), else ``float32``.

``CLOSEDLOOP_CPU_FLAGS`` (space-separated), when set, replaces the flags read from the host:
a hypervisor that hides flags, or a test that plays another host class.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from closedloop.engine.precision import PRECISIONS
from closedloop.errors import EmulatedBf16Warning, PrecisionError

REQUESTS = ("auto", *PRECISIONS)
NATIVE_X86_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})
FLAGS_ENV = "CLOSEDLOOP_CPU_FLAGS"
RACE_MARGIN = 1.25
"""bf16 must multiply this many times faster than float32 for ``auto`` to pick it by race."""


@dataclass(frozen=True)
class CpuFacts:
    """What the precision policy reads off the host: its architecture and CPU flags."""

    arch: str
    flags: frozenset[str]
    source: str  # where the flags came from: /proc/cpuinfo, sysctl, CLOSEDLOOP_CPU_FLAGS, none

    @property
    def is_x86(self) -> bool:
        """Whether the flags are x86's, which name bf16 support exactly."""
        return self.arch in ("x86_64", "amd64", "AMD64", "i686", "i386")

    @property
    def native_bf16(self) -> bool | None:
        """True/False where the flags decide (x86 with readable flags); None where they cannot
        (another architecture, or no flags): a measured race must."""
        if self.is_x86 and self.source != "none":
            return bool(NATIVE_X86_FLAGS & self.flags)
        return None

    def bf16_flags(self) -> list[str]:
        """The flags that bear on bf16, for a reason string."""
        keep = NATIVE_X86_FLAGS | {"bf16", "avx512f", "avx2", "fma", "amx_tile", "sve"}
        return sorted(self.flags & keep)


def _proc_cpuinfo_flags(text: str) -> set[str]:
    flags: set[str] = set()
    for line in text.splitlines():
        key = line.split(":", 1)[0].strip().lower()
        if key in ("flags", "features"):
            flags.update(line.split(":", 1)[-1].split())
    return flags


def read_cpu_facts(cpuinfo: str | None = None) -> CpuFacts:
    """The host's CPU facts: ``CLOSEDLOOP_CPU_FLAGS`` if set, else ``cpuinfo`` text (default:
    ``/proc/cpuinfo``), else macOS's ``sysctl`` bf16 feature; ``source`` says which."""
    arch = platform.machine()
    override = os.environ.get(FLAGS_ENV)
    if override is not None:
        return CpuFacts(arch, frozenset(override.split()), FLAGS_ENV)
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo = None
    if cpuinfo is not None:
        flags = _proc_cpuinfo_flags(cpuinfo)
        if flags:
            return CpuFacts(arch, frozenset(flags), "/proc/cpuinfo")
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"],
                                 capture_output=True, text=True, timeout=5, check=False)
            flags = {"bf16"} if out.stdout.strip() == "1" else set()
            return CpuFacts(arch, frozenset(flags), "sysctl")
        except OSError:
            pass
    return CpuFacts(arch, frozenset(), "none")


@dataclass(frozen=True)
class MatmulRates:
    """A bare square GEMM's rate per dtype on this host, measured side by side."""

    size: int
    float32_gflops: float
    bfloat16_gflops: float

    @property
    def bf16_speedup(self) -> float:
        """How many times faster bf16 multiplies than float32 (< 1: slower)."""
        return self.bfloat16_gflops / self.float32_gflops


def measure_matmul_rates(size: int = 512, reps: int = 3) -> MatmulRates:
    """Time ``size``² @ ``size``² in float32 and in bfloat16 (after one warm-up each); the best
    of ``reps`` per dtype, in GFLOP/s (2·size³ operations). About a second where bf16 is
    emulated; milliseconds where it is native."""
    gen = torch.Generator().manual_seed(0)
    a32 = torch.randn(size, size, generator=gen)
    b32 = torch.randn(size, size, generator=gen)
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = a32.to(dtype), b32.to(dtype)
        torch.matmul(a, b)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.matmul(a, b)
            best = min(best, time.perf_counter() - t0)
        rates[dtype] = 2 * size**3 / max(best, 1e-9) / 1e9
    return MatmulRates(size, rates[torch.float32], rates[torch.bfloat16])


@dataclass(frozen=True)
class PrecisionChoice:
    """The run's resolved precision: what was asked, what is used, and why."""

    requested: str
    precision: str
    native_bf16: bool | None
    reason: str
    flags_source: str
    rates: dict[str, float] | None = None  # MatmulRates' fields where a race was run
    device: str = "cpu"  # where the policy computes (closedloop.engine.device)

    @property
    def emulated_bf16(self) -> bool:
        """bf16 chosen on a host that does not multiply it natively."""
        return self.precision == "bfloat16" and self.native_bf16 is False

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (what ``config.json`` records)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> PrecisionChoice:
        """The record ``to_dict`` wrote; ``PrecisionError`` naming the field otherwise."""
        if not isinstance(data, dict):
            raise PrecisionError(f"a recorded precision must be an object, got {data!r}")
        try:
            choice = cls(**data)
        except TypeError as exc:
            raise PrecisionError(f"recorded precision {data!r}: {exc}") from None
        if choice.precision not in PRECISIONS or choice.requested not in REQUESTS:
            raise PrecisionError(f"recorded precision {data!r}: precision must be one of "
                                 f"{PRECISIONS} and requested one of {REQUESTS}")
        return choice

    def describe(self) -> str:
        """One line for logs and the report: ``float32 (auto: ...)``."""
        return f"{self.precision} ({self.requested}: {self.reason})"


def _rates_text(rates: MatmulRates) -> str:
    return (f"a {rates.size}² matmul measured {rates.float32_gflops:.1f} GFLOP/s in float32 and "
            f"{rates.bfloat16_gflops:.1f} in bfloat16")


def resolve_on_cuda(requested: str, bf16_supported: bool | None = None,
                    name: str | None = None) -> PrecisionChoice:
    """The module's rule on a CUDA device: native bf16 where the GPU supports it
    (``bf16_supported``/``name`` default to the current device's)."""
    if requested not in REQUESTS:
        raise PrecisionError(f"precision must be one of {REQUESTS}, got {requested!r}")
    if bf16_supported is None:
        bf16_supported = bool(torch.cuda.is_bf16_supported())
    name = name or torch.cuda.get_device_name()
    why = (f"CUDA device {name} " + ("multiplies bf16 natively" if bf16_supported
                                     else "has no native bf16"))
    precision = "bfloat16" if requested == "bfloat16" or (requested == "auto"
                                                           and bf16_supported) else "float32"
    if requested != "auto":
        why = f"requested; {why}"
    return PrecisionChoice(requested, precision, bf16_supported, why, f"cuda:{name}",
                           device="cuda")


def resolve_precision(requested: str, facts: CpuFacts | None = None,
                      measure: Callable[[], MatmulRates] | None = None,
                      device: str = "cpu") -> PrecisionChoice:
    """Resolve ``requested`` (one of ``REQUESTS``) on the host ``facts`` describe (default: this
    one) by the module's rule. ``measure`` runs the race where one is needed (default:
    ``measure_matmul_rates``). ``device="cuda"``: the GPU decides (``resolve_on_cuda``)."""
    if requested not in REQUESTS:
        raise PrecisionError(f"precision must be one of {REQUESTS}, got {requested!r}")
    if device == "cuda":
        return resolve_on_cuda(requested)
    facts = facts if facts is not None else read_cpu_facts()
    native = facts.native_bf16
    flags = " ".join(facts.bf16_flags()) or "none of the bf16 flags"
    if native is True:
        why = f"this CPU multiplies bf16 natively ({flags})"
    elif native is False:
        why = (f"this CPU has no native bf16 (flags: {flags}; no amx_bf16 or avx512_bf16): "
               "bf16 matmuls would be emulated")
    else:
        why = f"{facts.arch} CPU, flags from {facts.source}: {flags}"
    if requested == "float32":
        return PrecisionChoice(requested, "float32", native, f"requested; {why}", facts.source)
    rates = None
    if native is None or (requested == "bfloat16" and native is False):
        rates = (measure or measure_matmul_rates)()
        why += f"; {_rates_text(rates)}"
        if native is None:
            native = rates.bf16_speedup >= RACE_MARGIN
    precision = "bfloat16" if requested == "bfloat16" or native else "float32"
    return PrecisionChoice(requested, precision, native, why, facts.source,
                           asdict(rates) if rates is not None else None)


def warn_if_emulated(choice: PrecisionChoice) -> str | None:
    """Warn (``EmulatedBf16Warning``) when ``choice`` runs bf16 on a host that emulates it;
    return the message (None when there is nothing to say)."""
    if not choice.emulated_bf16:
        return None
    slow = ""
    if choice.rates:
        speed = choice.rates["bfloat16_gflops"] / choice.rates["float32_gflops"]
        slow = f" measured {1 / max(speed, 1e-9):.0f}x slower than float32 here;"
    message = (f"bfloat16 was forced on a host that emulates it:{slow} every matmul of the run "
               "(warm start, sampling, training, evaluation) will pay it. Use precision: auto "
               "or float32 on this host.")
    warnings.warn(message, EmulatedBf16Warning, stacklevel=2)
    return message


def resolve_for_run(requested: str, recorded: Any, facts: CpuFacts | None = None,
                    measure: Callable[[], MatmulRates] | None = None,
                    device: str = "cpu") -> PrecisionChoice:
    """The precision of a run, resolved once: ``recorded`` (what the run's first launch
    resolved, from ``config.json``) when it answers the same request, so a resumed run keeps its
    precision on any host (or device); else resolved now on ``device``. Either way, bf16 on a
    CPU host that emulates it warns (``warn_if_emulated``) before the first step."""
    if recorded is not None:
        choice = PrecisionChoice.from_dict(recorded)
        if choice.requested == requested and device == "cuda":
            return choice
        if choice.requested == requested:
            here = facts if facts is not None else read_cpu_facts()
            if choice.precision == "bfloat16" and here.native_bf16 is False:
                rates = (measure or measure_matmul_rates)()
                choice = PrecisionChoice(choice.requested, choice.precision, False,
                                         f"recorded by the run's first launch; this host "
                                         f"emulates bf16: {_rates_text(rates)}",
                                         here.source, asdict(rates))
            warn_if_emulated(choice)
            return choice
    choice = resolve_precision(requested, facts, measure, device)
    warn_if_emulated(choice)
    return choice

"""The precision policy (``closedloop.engine.host_precision``): ``auto`` follows what the host
multiplies fast, ``float32`` is always float32, a forced ``bfloat16`` on a host that emulates it
warns with the measured slowdown, and a run keeps the precision its first launch resolved."""

from __future__ import annotations

import warnings

import pytest

from closedloop.engine import (
    CpuFacts,
    MatmulRates,
    PrecisionChoice,
    read_cpu_facts,
    resolve_for_run,
    resolve_precision,
)
from closedloop.errors import EmulatedBf16Warning, PrecisionError

AVX2 = CpuFacts("x86_64", frozenset({"fpu", "sse2", "avx", "avx2", "fma"}), "/proc/cpuinfo")
AVX512 = CpuFacts("x86_64", frozenset({"avx2", "avx512f", "avx512bw"}), "/proc/cpuinfo")
AMX = CpuFacts("x86_64", frozenset({"avx512f", "amx_tile", "amx_bf16", "amx_int8"}),
               "/proc/cpuinfo")
EPYC_BF16 = CpuFacts("x86_64", frozenset({"avx2", "avx512f", "avx512_bf16"}), "/proc/cpuinfo")
ARM_BF16 = CpuFacts("aarch64", frozenset({"fp", "asimd", "sve", "bf16"}), "/proc/cpuinfo")
UNKNOWN = CpuFacts("x86_64", frozenset(), "none")

# the AVX2 host's bare 1024² GEMM: 111 GFLOP/s in float32, 0.9 in bfloat16 (123x slower)
EMULATED = MatmulRates(1024, 111.0, 0.9)
NATIVE = MatmulRates(512, 300.0, 2400.0)


def no_race() -> MatmulRates:
    raise AssertionError("the CPU flags decide on x86: no race may run")


@pytest.mark.parametrize("facts", [AVX2, AVX512], ids=["avx2", "avx512-without-bf16"])
def test_auto_is_float32_on_a_cpu_without_native_bf16(facts: CpuFacts) -> None:
    choice = resolve_precision("auto", facts, no_race)
    assert choice.precision == "float32" and choice.native_bf16 is False
    assert "no native bf16" in choice.reason and "emulated" in choice.reason


@pytest.mark.parametrize(("facts", "flag"), [(AMX, "amx_bf16"), (EPYC_BF16, "avx512_bf16")])
def test_auto_is_bfloat16_where_the_cpu_multiplies_it_natively(facts: CpuFacts,
                                                               flag: str) -> None:
    choice = resolve_precision("auto", facts, no_race)
    assert choice.precision == "bfloat16" and choice.native_bf16 is True
    assert flag in choice.reason


@pytest.mark.parametrize("facts", [AVX2, AMX, EPYC_BF16, ARM_BF16])
def test_float32_is_float32_on_every_host(facts: CpuFacts) -> None:
    assert resolve_precision("float32", facts, no_race).precision == "float32"


@pytest.mark.parametrize("facts", [AMX, EPYC_BF16])
def test_bfloat16_asked_on_a_native_host_is_bfloat16_without_a_warning(facts: CpuFacts) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        choice = resolve_for_run("bfloat16", None, facts, no_race)
    assert choice.precision == "bfloat16" and not choice.emulated_bf16


def test_forcing_bfloat16_on_an_emulating_host_warns_with_the_measured_slowdown() -> None:
    with pytest.warns(EmulatedBf16Warning, match=r"measured 123x slower than float32"):
        choice = resolve_for_run("bfloat16", None, AVX2, lambda: EMULATED)
    assert choice.precision == "bfloat16" and choice.emulated_bf16
    assert choice.rates == {"size": 1024, "float32_gflops": 111.0, "bfloat16_gflops": 0.9}
    assert "0.9 in bfloat16" in choice.reason


@pytest.mark.parametrize(("rates", "expected"), [(NATIVE, "bfloat16"), (EMULATED, "float32")])
def test_where_flags_cannot_decide_a_measured_race_does(rates: MatmulRates,
                                                        expected: str) -> None:
    for facts in (ARM_BF16, UNKNOWN):
        choice = resolve_precision("auto", facts, lambda r=rates: r)
        assert choice.precision == expected
        assert choice.rates is not None and "GFLOP/s" in choice.reason


def test_a_run_keeps_the_precision_its_first_launch_resolved() -> None:
    first = resolve_for_run("auto", None, AMX, no_race)
    assert first.precision == "bfloat16"
    # resumed on a host of the same class: the record is reused, nothing is measured again
    assert resolve_for_run("auto", first.to_dict(), AMX, no_race) == first
    # resumed on an AVX2 host: still bf16 (one precision per run), with the slowdown named
    with pytest.warns(EmulatedBf16Warning, match="123x slower"):
        moved = resolve_for_run("auto", first.to_dict(), AVX2, lambda: EMULATED)
    assert moved.precision == "bfloat16"
    # a declared change of the request resolves again
    assert resolve_for_run("float32", first.to_dict(), AMX, no_race).precision == "float32"


def test_a_recorded_precision_is_checked() -> None:
    good = resolve_precision("auto", AVX2, no_race).to_dict()
    assert PrecisionChoice.from_dict(good).precision == "float32"
    for bad in ({**good, "precision": "fp16"}, {**good, "requested": "fast"}, {"x": 1}, "f32"):
        with pytest.raises(PrecisionError):
            PrecisionChoice.from_dict(bad)
    with pytest.raises(PrecisionError, match="auto"):
        resolve_precision("fp16", AVX2, no_race)


def test_cpu_facts_are_read_from_cpuinfo_and_can_be_overridden(monkeypatch) -> None:
    monkeypatch.delenv("CLOSEDLOOP_CPU_FLAGS", raising=False)
    facts = read_cpu_facts("processor : 0\nflags\t\t: fpu sse2 avx512f amx_bf16 amx_tile\n")
    assert {"amx_bf16", "avx512f"} <= facts.flags and facts.source == "/proc/cpuinfo"
    arm = read_cpu_facts("processor : 0\nFeatures : fp asimd sve bf16 i8mm\n")
    assert "bf16" in arm.flags
    monkeypatch.setenv("CLOSEDLOOP_CPU_FLAGS", "avx2 fma")
    over = read_cpu_facts("flags : amx_bf16\n")
    assert over.flags == {"avx2", "fma"} and over.source == "CLOSEDLOOP_CPU_FLAGS"


def test_this_host_resolves_to_a_precision_with_a_reason(monkeypatch) -> None:
    monkeypatch.delenv("CLOSEDLOOP_CPU_FLAGS", raising=False)
    facts = read_cpu_facts()
    choice = resolve_precision("auto", facts)
    assert choice.precision in ("float32", "bfloat16") and choice.reason
    if facts.native_bf16 is not None:
        assert choice.precision == ("bfloat16" if facts.native_bf16 else "float32")

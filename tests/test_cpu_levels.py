"""CPU capability levels (DESIGN.md §9): one build, the best kernels the CPU has, chosen at load.

The kernel tests themselves run once per level this CPU supports (the `cpu_level` fixture of
conftest.py); here: the choice, its override, the code each level may contain, and the module
running on CPUs this machine is not (qemu-user emulating a Haswell, a Zen 3 and a Nehalem).
"""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pflcore._core as core

X86 = platform.machine().lower() in ("x86_64", "amd64")
ROOT = Path(__file__).resolve().parents[1]
SMALL_CALL = Path(__file__).with_name("native") / "small_call.py"


def _run(code: str, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_levels_built_supported_and_in_use():
    built, supported = core.cpu_capabilities_built(), core.cpu_capabilities_supported()
    if core.build_info()["cpu_capabilities_built"] == ["native"]:
        pytest.skip("a -march=native build (PFLCORE_MARCH_NATIVE=ON) has one level")  # not CI's build
    assert built == (["baseline", "avx2", "avx512"] if X86 else ["baseline"])
    assert supported[0] == "baseline" and set(supported) <= set(built)
    assert supported == built[:len(supported)]  # a CPU with AVX-512 has AVX2
    forced = os.environ.get("PFLCORE_CPU_CAPABILITY")
    assert core.cpu_capability() == (forced or supported[-1])


def test_set_cpu_capability_switches_and_refuses():
    before = core.cpu_capability()
    try:
        for level in core.cpu_capabilities_supported():
            core.set_cpu_capability(level)
            assert core.cpu_capability() == level
        with pytest.raises(ValueError, match=r"cpu capability: expected one of .*got 'sse9' \(not a level"):
            core.set_cpu_capability("sse9")
        assert core.cpu_capability() == core.cpu_capabilities_supported()[-1]  # unchanged by the refusal
        missing = [lv for lv in core.cpu_capabilities_built() if lv not in core.cpu_capabilities_supported()]
        for level in missing:
            with pytest.raises(ValueError, match=f"got '{level}' \\(it needs .* which this CPU lacks\\)"):
                core.set_cpu_capability(level)
    finally:
        core.set_cpu_capability(before)


def test_environment_variable_forces_a_level_and_refuses_a_bad_one():
    r = _run("import pflcore._core as c; print(c.cpu_capability())", PFLCORE_CPU_CAPABILITY="baseline")
    assert r.returncode == 0 and r.stdout.strip() == "baseline", r.stderr
    # an op refuses to run rather than fall back to another level or to the reference backend
    r = _run("import torch, pflcore\nfrom pflcore import ops\n"
             "ops.average(torch.ones(3, 2), torch.ones(3))", PFLCORE_CPU_CAPABILITY="avx9000")
    assert r.returncode == 1
    assert ("ValueError: PFLCORE_CPU_CAPABILITY: expected one of baseline" in r.stderr
            and "got 'avx9000' (not a level of this build" in r.stderr), r.stderr[-2000:]


# ---- what each level's code may contain ---------------------------------------------------------

# Instructions that need AVX (VEX encoding: every v-mnemonic), and those that need AVX-512
# (zmm, mask registers, the upper 16 vector registers, EVEX-only mnemonics).
_AVX = re.compile(r"%ymm|\tv[a-z0-9]+\b")
_AVX512 = re.compile(r"%zmm|%k[0-7]\b|%[xy]mm(1[6-9]|2[0-9]|3[01])\b|\tv(pternlog|permt2|permi2|pmov(s|us)?(qd|qw|qb|dw|db|wb)\b|pmovm2|pmov[bwdq]2m|"
                     r"rndscale|rcp14|rsqrt14|scalef|getexp|getmant|fixupimm|range|reduce|fpclass|pcompress|"
                     r"compress|expand|pconflict|plzcnt|pabsq|pmaxsq|pminsq|pmaxuq|pminuq|psraq|pmullq|prol|pror|"
                     r"extract[if](32x4|64x2|32x8|64x4)|insert[if](32x4|64x2|32x8|64x4)|shuf[if](32x4|64x2)|"
                     r"align[dq]|blendm|pblendm|cvt[a-z]*qq|cvt[a-z]*u[dq]q|cvtu)")


def _build_tree_module():
    """The unstripped module of the build tree pip left in build/<wheel tag>/ (pyproject.toml:
    build-dir; CMakeLists.txt: NO_EXTRAS), not that of another build (build/bench-native, ...)."""
    candidates = sorted(ROOT.glob("build/*-*-*/_core.*.so"), key=lambda p: p.stat().st_mtime)
    return candidates[-1] if candidates else None


@pytest.mark.skipif(not X86, reason="the instruction sets checked are x86's")
def test_no_function_outside_a_level_uses_that_levels_instructions():
    """The linker keeps one copy of an inline function that several levels instantiate: if that
    were a higher level's copy, a lower level (and the dispatcher) would call it: SIGILL on a CPU
    without those instructions. Every function compiled for AVX2 or AVX-512 must therefore live in
    that level's namespace (cpu_avx2 / cpu_avx512), and no other code may use those instructions."""
    so = _build_tree_module()
    objdump = shutil.which("objdump")
    if so is None or objdump is None:
        pytest.skip("needs the build tree of `pip install .` (build/<tag>/_core*.so) and binutils' objdump")
    text = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", str(so)], capture_output=True, text=True,
                          check=True).stdout
    assert "cpu_avx2::" in text and "cpu_avx512::" in text, "no symbols: the build tree's module was stripped"
    # GCC's clones of a function for one translation unit (".constprop", ".isra", ".part": local
    # symbols, `t` in nm) are called from that unit only: made in a level's unit, only that
    # level's code calls them, whatever their name
    nm = subprocess.run([shutil.which("nm") or "nm", "-C", str(so)], capture_output=True, text=True, check=True).stdout
    local_clones = {m.group(1) for m in re.finditer(r"^[0-9a-f]+ t (.*\[clone \.(?:constprop|isra|part)\.\d+\].*)$", nm,
                                                   re.MULTILINE)}
    offenders = {}
    fn = None
    for line in text.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if head:
            fn = head.group(1)
            continue
        if fn is None or "cpu_avx512::" in fn or fn in local_clones:
            continue
        bad = _AVX512.search(line) if "cpu_avx2::" in fn else _AVX.search(line)
        if bad:
            offenders.setdefault(fn, line.strip())
    assert not offenders, "\n".join(f"{f[:160]}: {i}" for f, i in list(offenders.items())[:20])


# ---- the module on other CPUs ---------------------------------------------------------------------

QEMU = shutil.which("qemu-x86_64")
# (qemu CPU model, the level the module must choose there)
EMULATED = [("Haswell", "avx2"), ("EPYC-Milan", "avx2"), ("Nehalem", "baseline")]


# settings that force this machine's instruction sets on a library: not for an emulated CPU
_HOST_SETTINGS = ("PFLCORE_CPU_CAPABILITY", "OPENBLAS_CORETYPE", "ATEN_CPU_CAPABILITY", "NPY_DISABLE_CPU_FEATURES")


def _small_call(prefix=(), **env):
    base = {k: v for k, v in os.environ.items() if not (prefix and k in _HOST_SETTINGS)}
    r = subprocess.run([*prefix, sys.executable, str(SMALL_CALL), core.__file__], capture_output=True, text=True,
                       timeout=600, env={**base, **env})
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-3000:]}"
    return json.loads(r.stdout)


@pytest.mark.skipif(not (X86 and QEMU), reason="needs qemu-x86_64 (Debian's qemu-user; .ci/run installs it)")
@pytest.mark.parametrize("cpu,level", EMULATED)
def test_module_runs_on_an_emulated_cpu(cpu, level):
    """The module built here runs a small local_steps call on a CPU without AVX-512 (and one
    without AVX), choosing the level that CPU has, with the results of that level here."""
    emulated = _small_call(prefix=[QEMU, "-cpu", cpu])
    assert emulated["level"] == level
    if level not in core.cpu_capabilities_supported():
        pytest.skip(f"this CPU cannot run '{level}' natively to compare with")  # the call above still ran
    here = _small_call(PFLCORE_CPU_CAPABILITY=level)
    assert emulated["batches"] == here["batches"] and emulated["labels"] == here["labels"]
    for key in ("softmax_f32", "logistic_f64"):
        # same code; only libm's exp (chosen by glibc for the CPU it sees) may round differently
        assert emulated[key] == pytest.approx(here[key], rel=1e-5, abs=1e-6), key


def test_public_threads_and_capability_functions():
    import pflcore
    from pflcore import backend
    before = pflcore.get_num_threads()
    try:
        pflcore.set_num_threads(1)
        assert pflcore.get_num_threads() == 1
        for bad in (0, -2, 1.5, True, "2"):
            with pytest.raises(ValueError, match=r"^n: expected an integer >= 1, got "):
                pflcore.set_num_threads(bad)
    finally:
        pflcore.set_num_threads(before)
    assert backend.cpu_capability() == core.cpu_capability()
    level = backend.cpu_capability()
    try:
        backend.set_cpu_capability("baseline")
        assert backend.cpu_capability() == "baseline"
        with pytest.raises(ValueError, match=r"^level: expected one of \['baseline'"):
            backend.set_cpu_capability(2)
    finally:
        backend.set_cpu_capability(level)

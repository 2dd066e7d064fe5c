"""The C/Python boundary of the kernel libraries is checked, not trusted
(tartlet/engine/kernels/abi.py, abi.h): each library's table of struct sizes,
field offsets and enum values equals what its ctypes wrapper declares, a
drift on either side is refused naming what drifted, and every export carries
the one ``tq_`` prefix."""

import ctypes
import shutil
import subprocess

import pytest

from tartlet.engine.kernels import abi, cpu_kernels, quant_kernels


@pytest.fixture(scope="module")
def libs():
    q, c = quant_kernels.load(), cpu_kernels.load()
    assert q is not None and c is not None, "the C kernels must build on this machine (gcc is a test prerequisite)"
    return {"quant": q._lib, "cpu": c._lib}


def test_tables_match_the_wrappers(libs):
    table = abi.read_table(libs["quant"])
    assert table == {"version": abi.ABI_VERSION, **quant_kernels.abi_entries()}
    for c_name, struct in quant_kernels.STRUCTS.items():  # every struct the wrapper builds is described by C
        assert table[f"size {c_name}"] == ctypes.sizeof(struct)
    assert table["enum TQ_KV_Q8"] == abi.KV_KINDS[__import__("torch").int8] == 1
    # one KV-kind enum: both libraries report the same values
    cpu = abi.read_table(libs["cpu"])
    assert {k: v for k, v in cpu.items() if k.startswith("enum TQ_KV_")} == abi.kv_kind_entries()
    assert {k: v for k, v in table.items() if k.startswith("enum TQ_KV_")} == abi.kv_kind_entries()


def test_a_struct_that_drifted_is_refused_naming_the_field(libs):
    class LinearDescMissingBf16(ctypes.Structure):  # the C struct gained a field the wrapper lacks
        _fields_ = [f for f in quant_kernels.LinearDesc._fields_ if f[0] != "bf16"]

    expected = quant_kernels.abi_entries()
    expected = {k: v for k, v in expected.items() if " tq_linear_desc" not in k}
    expected.update(abi.struct_entries("tq_linear_desc", LinearDescMissingBf16))
    with pytest.raises(abi.KernelAbiError) as e:
        abi.check(libs["quant"], "quant kernels", expected)
    msg = str(e.value)
    assert "offset tq_linear_desc.bf16 = " in msg and "not declared by the Python wrapper" in msg
    assert "size tq_linear_desc is " in msg


def test_an_enum_that_drifted_is_refused(libs):
    expected = quant_kernels.abi_entries()
    expected["enum K_Q4"] += 1
    expected["enum K_EXTRA"] = 42
    with pytest.raises(abi.KernelAbiError) as e:
        abi.check(libs["quant"], "quant kernels", expected)
    assert "enum K_Q4 is 1 in C but 2 in the Python wrapper" in str(e.value)
    assert "enum K_EXTRA = 42 in the Python wrapper, not in the C library's table" in str(e.value)
    saved = abi.ABI_VERSION
    with pytest.raises(abi.KernelAbiError, match=f"version is {saved} in C but {saved + 1}"):
        try:
            abi.ABI_VERSION = saved + 1
            abi.check(libs["cpu"], "cpu kernels", abi.kv_kind_entries())
        finally:
            abi.ABI_VERSION = saved


@pytest.mark.skipif(shutil.which("nm") is None, reason="binutils' nm is not installed")
def test_every_export_has_the_tq_prefix(libs):
    for name, lib in libs.items():
        out = subprocess.run(["nm", "-D", "--defined-only", lib._name], capture_output=True, text=True, check=True).stdout
        exports = [line.split()[-1] for line in out.splitlines() if line.split()[1:2] == ["T"]]
        assert exports and all(s.startswith("tq_") for s in exports), (name, [s for s in exports if not s.startswith("tq_")])

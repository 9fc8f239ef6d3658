"""What this CPU can do, for choosing kernels and precision at run time.

One install runs on CPUs of different kinds (AVX2 only; AVX-512 with AVX512-BF16 and AMX), so
nothing is decided at install time: every choice reads `detect()`.
The flags come from /proc/cpuinfo (Linux); torch's own dispatch level (`get_cpu_capability`) caps
the vector ISA, so an OS or torch build that disables AVX-512 is respected.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuCaps:
    avx2: bool = False
    fma: bool = False
    avx512: bool = False  # AVX-512 F/BW/VL/DQ, what torch's AVX512 kernels need
    avx512_bf16: bool = False  # vdpbf16ps: native bf16 dot products
    amx_bf16: bool = False
    amx_int8: bool = False
    avx512_vnni: bool = False  # int8 dot products on 512-bit vectors
    avx_vnni: bool = False  # int8 dot products on 256-bit vectors (Alder Lake, Sapphire Rapids, Zen 5)
    torch_capability: str = "DEFAULT"  # torch.backends.cpu.get_cpu_capability()
    vendor: str = ""  # /proc/cpuinfo's vendor_id: GenuineIntel, AuthenticAMD, ...

    @property
    def native_bf16(self) -> bool:
        """bf16 GEMMs in hardware (AMX or AVX512-BF16): bf16 runs faster than fp32 here, not slower."""
        return self.amx_bf16 or self.avx512_bf16

    @property
    def bf16_dot_outruns_fma(self) -> bool:
        """AVX512-BF16 dot products (32 products an instruction) issued at the rate of 512-bit fp32 FMAs
        (16): AMD Zen 4/5, by AMD's documented rates. On an Intel Xeon with AVX512-BF16 (AMX not
        exposed) fp32 FMAs over bf16 weights widened as they stream ran its bf16 GEMMs faster than its
        dot products did (docs/batch-invariance.md)."""
        return self.avx512_bf16 and self.avx512 and self.vendor == "AuthenticAMD"

    @property
    def int8_dot(self) -> bool:
        """int8 dot products in hardware (VNNI or AMX-int8)."""
        return self.amx_int8 or self.avx512_vnni or self.avx_vnni

    @property
    def vector_isa(self) -> str:
        """The widest vector ISA kernels may use: 'avx512', 'avx2' or 'generic'."""
        if self.avx512 and self.torch_capability == "AVX512":
            return "avx512"
        if self.avx2 and self.fma and self.torch_capability in ("AVX2", "AVX512"):
            return "avx2"
        return "generic"

    def describe(self) -> str:
        names = [
            name
            for name in ("avx2", "fma", "avx512", "avx512_bf16", "amx_bf16", "amx_int8", "avx512_vnni", "avx_vnni")
            if getattr(self, name)
        ]
        return f"{'+'.join(names) or 'no SIMD extensions'} (torch dispatch {self.torch_capability})"


def caps_from_flags(flags: set[str], torch_capability: str, vendor: str = "") -> CpuCaps:
    return CpuCaps(
        avx2="avx2" in flags,
        fma="fma" in flags,
        avx512={"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags,
        avx512_bf16="avx512_bf16" in flags,
        amx_bf16="amx_bf16" in flags and "amx_tile" in flags,
        amx_int8="amx_int8" in flags and "amx_tile" in flags,
        avx512_vnni="avx512_vnni" in flags,
        avx_vnni="avx_vnni" in flags,
        torch_capability=torch_capability,
        vendor=vendor,
    )


def _cpuinfo(path: Path = Path("/proc/cpuinfo")) -> tuple[set[str], str]:
    """The first processor's flags and vendor_id."""
    vendor = ""
    try:
        for line in path.read_text().splitlines():
            if line.startswith("vendor_id") and not vendor:
                vendor = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split()), vendor
    except OSError:
        pass
    return set(), vendor


@functools.cache
def detect() -> CpuCaps:
    import torch

    flags, vendor = _cpuinfo()
    return caps_from_flags(flags, torch.backends.cpu.get_cpu_capability(), vendor)

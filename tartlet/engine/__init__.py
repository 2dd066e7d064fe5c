"""The engine: model execution, KV pages, scheduling (see docs/architecture.md).

oneDNN (PyTorch's CPU kernels for bfloat16 matrix products) uses Intel AMX
tiles where the CPU advertises them. Some virtual machines advertise AMX in
CPUID but trap its instructions, which kills the process with SIGILL on the
first bfloat16 matmul (seen on this project's Sapphire Rapids VMs). Unless
the user chose an ISA, oneDNN is capped below AMX (``ONEDNN_MAX_CPU_ISA``,
read by oneDNN at its first primitive, so this must run before one). Tartlet's
own paths (float32, quantized) do not use AMX, so nothing else is lost.
"""

import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_FP16")

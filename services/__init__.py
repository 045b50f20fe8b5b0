"""pdserve: disaggregated prefill/decode LLM serving."""

import os

# torch's CPU build picks an AMX bf16 path that these VMs cannot run (SIGILL); cap oneDNN's ISA
# before torch is imported anywhere below this package.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

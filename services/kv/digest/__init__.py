"""The KV digest: its definition and host arithmetic (``scheme``), the same sum as one Triton kernel (``kernel``),
and a rank's digest jobs run where the KV lives (``runner``)."""

"""The GPU engine: cuSPARSELt's 2:4 GEMM on sm80+ GPUs (``sparse_op``), from which token
count it beats dense (``dispatch_plans``), and the modules that run it (``kernels``)."""

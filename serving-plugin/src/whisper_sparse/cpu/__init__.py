"""The CPU engine: native kernels for compressed layers on x86 CPUs.

* ``kernels/``: one C++ file per instruction set (AVX2, AVX-512, AVX-512 BF16 and its 2:4
  and unstructured GEMMs), the torch ops and their paths by token count (``op.cpp``), the
  run-time dispatch from the CPU's flags (``op_isa.cpp``), the GEMM path over the threads
  (``op_gemm.cpp``) and the prefill tiles (``op_tiles.cpp``; ``op_amx.cpp``: the op's AMX
  tiles; ``op_brgemm.cpp``: through oneDNN's micro-kernel);
* ``build``: compiled on first use into the cache; ``op``: the sparse CPU op's wrappers, its
  ``PATHS`` and ``PathThresholds``, and the pure-torch reference the tests compare with;
* ``grouped_layout``, ``row_spread``: an unstructured layer's layouts in memory;
* ``served_layer``: the one factory of a layer's served form (2:4, spread rows, grouped);
* ``plan_timing``, ``plans``: which path each shape takes at each token count, measured on
  random served layers and cached;
* ``linear``: the modules that hold a served layer and run the op;
* ``int8``, ``fp8``: what the vLLM plugin runs where vLLM's own CPU kernels fall short.
"""

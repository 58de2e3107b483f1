"""vLLM's side: the ``vllm.general_plugins`` entry (``plugin``), the quantization config and
linear methods it registers (``layers``), the compressed tensors loaded and checked through
vLLM's own weight loaders (``loading``), and the plugin's part of vLLM's compile-cache key
(``compile_key``). Only ``plugin.register`` imports vLLM, once vLLM runs."""

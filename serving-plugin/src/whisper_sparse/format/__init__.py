"""The compressed layouts on disk and their checks (pure torch and safetensors):

* ``two_four``: 2:4 weights as their kept values plus a bitmask (compressed-tensors'
  legacy ``sparse-24-bitmask`` tensors), and ``CorruptCheckpointError``;
* ``bitmask``: unstructured weights as each row's kept values, a bitmask and row offsets
  (compressed-tensors' legacy ``sparse-bitmask`` tensors);
* ``layout``: a saved checkpoint's Linear weights rewritten in these layouts and declared
  in ``config.json``, checked before any weight loads, and read back dense.
"""

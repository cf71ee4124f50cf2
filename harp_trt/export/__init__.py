"""The export stage: the dense ONNX graph with a KV cache (opset 23), traced on fake tensors and
bound to the safetensors weights (``export.py``), its initializer passes (``initializers.py``) and
its light ``config.py``. ``export.py`` is imported on its own: it pulls in torch. The stage checks
its graph with ``harp_trt.verify`` (core) and never imports the rewrite stage, so a rule change
never re-exports (``harp_trt/codekey.py``)."""

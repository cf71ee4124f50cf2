"""Stage 3, build: turn an ONNX graph (dense export or HARP rewrite) or a plan into something that
serves: ``ort`` (ONNX Runtime engine folders), ``trtllm`` (TensorRT-LLM checkpoints and the
``trtllm-build`` script), ``triton`` (model repositories around either).

Backends are registered in the one registry, ``harp_trt.registry.BACKENDS`` / ``STAGES``, as
``"module:Class"`` strings: ``import builders`` pulls in no runtime (onnxruntime, TensorRT-LLM,
Triton), and each backend's config lives in a light ``config.py`` the CLI reads."""

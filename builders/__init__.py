"""Stage 3, build: turn an ONNX graph (dense export or HARP rewrite) or a plan into something that
serves: ``ort`` (ONNX Runtime engine folders), ``trtllm`` (TensorRT-LLM checkpoints and the
``trtllm-build`` script), ``triton`` (model repositories around either).

Each folder is a stage that declares itself in its light ``config.py`` (``STAGE``, a
``harp_trt.stage_spec.StageSpec`` naming its classes as ``"module:Class"`` strings), where
``harp_trt.registry.STAGES`` finds it; the pipeline's backends (``BACKENDS``) compose them.
``import builders`` pulls in no runtime (onnxruntime, TensorRT-LLM, Triton)."""

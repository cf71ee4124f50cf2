"""The rewrite stage: turn a dense ONNX export into the HARP graph (arXiv 2507.01900, Eq. 4-5).

Pruned layers' attention blocks become ``MatMul(MatMul(x, W_V) + b_V, alpha * W_O_fold)``
(``rules/``, ``harp_trt/fold.py``), their KV-cache inputs/outputs and dead Q/K/rotary nodes go
(``passes.py``), and the result is checked in ONNX Runtime against PyTorch (``harp_trt/verify.py``).
The dense export it starts from is its own stage, ``harp_trt/export/``."""
from __future__ import annotations

__all__ = ["HarpRewritePass", "RewriteResult", "LayerReport", "fold_o_proj", "RewriteConfig",
           "RewriteStage", "rewrite_onnx", "verify_rewrite", "VerifyConfig"]


def __getattr__(name):  # lazy: `import harp_trt.rewrite` stays cheap
    if name in ("HarpRewritePass", "RewriteResult", "LayerReport"):
        from . import passes

        return getattr(passes, name)
    if name == "fold_o_proj":
        from ..fold import fold_o_proj

        return fold_o_proj
    if name == "RewriteConfig":
        from .config import RewriteConfig

        return RewriteConfig
    if name in ("RewriteStage", "rewrite_onnx"):
        from . import stage

        return getattr(stage, name)
    if name in ("verify_rewrite", "VerifyConfig"):
        from .. import verify

        return getattr(verify, name)
    raise AttributeError(name)

"""Triton Python-backend model ``postprocessing`` (written by harp-trt): output token ids of the
``tensorrt_llm`` model -> text, one string per beam.

Parameters (config.pbtxt): ``tokenizer_dir`` (relative paths resolve against this file's folder) and
``skip_special_tokens``."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harp_tokenizer_models.py sits beside this file
from harp_tokenizer_models import TokenizerModel, flag, resolve_dir  # noqa: E402,F401

try:  # present inside Triton's Python backend only
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported outside Triton (tests, tooling): the helpers below still work
    pb_utils = None


def decode(tokenizer, tokens, lengths, skip_special_tokens=True):
    """tokens [B, beams, L] int, lengths [B, beams] -> [B, beams] array of UTF-8 bytes."""
    tokens = np.asarray(tokens)
    lengths = np.asarray(lengths).reshape(tokens.shape[0], tokens.shape[1])
    out = np.empty(lengths.shape, dtype=object)
    for b in range(tokens.shape[0]):
        for k in range(tokens.shape[1]):
            ids = tokens[b, k, :int(lengths[b, k])].tolist()
            out[b, k] = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens).encode("utf-8")
    return out


class TritonPythonModel(TokenizerModel):
    here = os.path.dirname(os.path.abspath(__file__))

    def initialize(self, args):
        super().initialize(args)
        self.skip_special = flag(self.params, "skip_special_tokens")

    def execute(self, requests):
        responses = []
        for request in requests:
            tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
            lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
            text = decode(self.tokenizer, tokens, lengths, self.skip_special)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", text)]))
        return responses

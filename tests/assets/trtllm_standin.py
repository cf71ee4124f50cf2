"""Stand-in for the C++ ``tensorrtllm`` model in integration tests: the same config.pbtxt (only the
backend set to python), answering with the prompt's tokens reversed (at most request_output_len),
so the test knows the text the ensemble must return through the real pre/post-processing models."""
import numpy as np
import triton_python_backend_utils as pb_utils


def _get(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


class TritonPythonModel:
    def initialize(self, args):
        pass

    def execute(self, requests):
        out = []
        for request in requests:
            ids = _get(request, "input_ids").reshape(-1)
            n = int(_get(request, "request_output_len").reshape(-1)[0])
            new = ids[::-1][:n].astype(np.int32)
            out.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("output_ids", new.reshape(1, 1, -1)),
                pb_utils.Tensor("sequence_length", np.array([[new.size]], np.int32)),
                pb_utils.Tensor("cum_log_probs", np.zeros((1, 1), np.float32)),
                pb_utils.Tensor("output_log_probs", np.zeros((1, 1, new.size), np.float32)),
            ]))
        return out

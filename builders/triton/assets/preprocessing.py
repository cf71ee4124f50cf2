"""Triton Python-backend model ``preprocessing`` (written by harp-trt): prompt text -> token ids for the
``tensorrt_llm`` model, with ``max_tokens`` clamped so prompt + output fit the engine's
``max_seq_len``, and stop / bad words in TensorRT-LLM's word-list layout.

Parameters (config.pbtxt): ``tokenizer_dir`` (relative paths resolve against this file's folder),
``add_special_tokens``, ``max_input_len`` and ``max_seq_len`` (the engine's build limits; 0 = no check)."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harp_tokenizer_models.py sits beside this file
from harp_tokenizer_models import TokenizerModel, flag, load_tokenizer, resolve_dir  # noqa: E402,F401

try:  # present inside Triton's Python backend only
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported outside Triton (tests, tooling): the helpers below still work
    pb_utils = None


def encode(tokenizer, queries, add_special_tokens):
    """Token ids of each query, right-padded with the pad id: ([B, L] int32, [B, 1] int32 lengths)."""
    ids = [tokenizer.encode(q, add_special_tokens=add_special_tokens) for q in queries]
    width = max([len(x) for x in ids] + [1])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = np.full((len(ids), width), pad, dtype=np.int32)
    for i, x in enumerate(ids):
        out[i, :len(x)] = x
    return out, np.array([[len(x)] for x in ids], dtype=np.int32)


def word_lists(tokenizer, words_per_item):
    """TensorRT-LLM word lists: per item a [2, W] array, row 0 the concatenated token ids of the words,
    row 1 the end offset of each word, -1 padded; an item without words is [[0], [-1]]. -> [B, 2, W]."""
    rows = []
    for words in words_per_item:
        flat, ends = [], []
        for w in words:
            ids = tokenizer.encode(w, add_special_tokens=False)
            if ids:
                flat += ids
                ends.append(len(flat))
        rows.append((flat, ends))
    width = max([max(len(f), len(e)) for f, e in rows] + [1])
    out = np.zeros((len(rows), 2, width), dtype=np.int32)
    out[:, 1, :] = -1
    for i, (f, e) in enumerate(rows):
        out[i, 0, :len(f)] = f
        out[i, 1, :len(e)] = e
    return out


def clamp_output_len(requested, input_lengths, max_seq_len):
    """``max_tokens`` per item, lowered so input + output <= max_seq_len (0 = no limit), at least 1."""
    req = np.asarray(requested, dtype=np.int32).reshape(-1, 1)
    if max_seq_len <= 0:
        return np.maximum(req, 1)
    room = max_seq_len - np.asarray(input_lengths, dtype=np.int32).reshape(-1, 1)
    return np.maximum(np.minimum(req, room), 1).astype(np.int32)


def _texts(array):
    """[B, N] bytes/str tensor -> list of lists of str (empty strings dropped)."""
    out = []
    for row in np.asarray(array, dtype=object).reshape(array.shape[0], -1):
        out.append([x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in row if x not in (b"", "")])
    return out


class TritonPythonModel(TokenizerModel):
    here = os.path.dirname(os.path.abspath(__file__))

    def initialize(self, args):
        super().initialize(args)
        self.add_special = flag(self.params, "add_special_tokens")
        self.max_input_len = int(self.params.get("max_input_len", "0") or 0)
        self.max_seq_len = int(self.params.get("max_seq_len", "0") or 0)
        eos = self.tokenizer.eos_token_id
        self.end_id = int(eos if eos is not None else 0)
        self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.end_id)

    def execute(self, requests):
        responses = []
        for request in requests:
            query = pb_utils.get_input_tensor_by_name(request, "QUERY").as_numpy()
            batch = query.shape[0]
            queries = [q[0] if q else "" for q in _texts(query)]
            ids, lengths = encode(self.tokenizer, queries, self.add_special)
            if self.max_input_len and int(lengths.max()) > self.max_input_len:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"prompt has {int(lengths.max())} tokens; the engine was built for at most "
                    f"{self.max_input_len} (max_input_len)")))
                continue
            out_len = clamp_output_len(
                pb_utils.get_input_tensor_by_name(request, "REQUEST_OUTPUT_LEN").as_numpy(), lengths,
                self.max_seq_len)
            words = {}
            for name in ("BAD_WORDS_DICT", "STOP_WORDS_DICT"):
                t = pb_utils.get_input_tensor_by_name(request, name)
                words[name] = word_lists(self.tokenizer, _texts(t.as_numpy()) if t is not None else [[]] * batch)
            ids_by_name = {}
            for name, default in (("END_ID", self.end_id), ("PAD_ID", self.pad_id)):
                t = pb_utils.get_input_tensor_by_name(request, name)
                ids_by_name[name] = (t.as_numpy().astype(np.int32).reshape(-1, 1) if t is not None
                                     else np.full((batch, 1), default, dtype=np.int32))
            tensors = [
                pb_utils.Tensor("INPUT_ID", ids), pb_utils.Tensor("REQUEST_INPUT_LEN", lengths),
                pb_utils.Tensor("REQUEST_OUTPUT_LEN", out_len),
                pb_utils.Tensor("BAD_WORDS_IDS", words["BAD_WORDS_DICT"]),
                pb_utils.Tensor("STOP_WORDS_IDS", words["STOP_WORDS_DICT"]),
                pb_utils.Tensor("OUT_END_ID", ids_by_name["END_ID"]),
                pb_utils.Tensor("OUT_PAD_ID", ids_by_name["PAD_ID"]),
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses

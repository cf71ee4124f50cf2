"""Triton Python-backend model: a HARP ONNX Runtime engine generating text inside the server.

Written by harp-trt into ``<repository>/<model>/1/model.py``; the engine (``model.onnx``,
``engine.json``, tokenizer files) sits beside it in ``1/engine/``. The KV cache is held here, in
the server; concurrent requests are batched continuously (``harp_trt.serving.BatchedGenerator``)
by one worker thread, so ``execute`` only validates and queues.

I/O follows Triton's vLLM backend, so its clients and the HTTP ``generate`` / ``generate_stream``
endpoints work unchanged: ``text_input`` (string), optional ``stream`` (bool),
``sampling_parameters`` (JSON string) and ``exclude_input_in_output`` (bool) -> ``text_output``.
Streaming responses carry the new text only; a non-streaming response carries the whole text
(the prompt first unless ``exclude_input_in_output``). Bad requests get an error response and the
model keeps serving. Needs ``harp-trt`` (for ``harp_trt.serving``), onnxruntime and transformers
in the Python environment the backend runs."""
import json
import threading
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _scalar(request, name, default=None):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    v = t.as_numpy().reshape(-1)
    if v.size == 0:
        return default
    v = v[0]
    return v.decode("utf-8") if isinstance(v, bytes) else v


def _text_response(text):
    out = pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))
    return pb_utils.InferenceResponse(output_tensors=[out])


def _error_response(message):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))


class _Detok:
    """Token ids -> text deltas; holds back an incomplete UTF-8 character."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.sent = tokenizer, [], 0

    def push(self, ids, final):
        self.ids += ids
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[self.sent:], len(text)
        return delta


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        from harp_trt.engine_spec import engine_model, engine_threads, is_engine, read_engine_spec
        from harp_trt.ort_session import OrtCausalLM
        from harp_trt.serving import BatchedGenerator

        config = json.loads(args["model_config"])
        self.name = args.get("model_name", "harp")
        params = {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}
        engine = Path(args["model_repository"]) / args["model_version"] / params.get("engine_dir", "engine")
        spec = read_engine_spec(engine) if is_engine(engine) else {}
        threads = engine_threads(spec, params.get("intra_op_threads"))
        providers = [p for p in params.get("providers", "").split(",") if p] or None
        self.lm = OrtCausalLM(engine_model(engine, spec), providers=providers, intra_op_threads=threads)
        self.tokenizer = AutoTokenizer.from_pretrained(str(engine), trust_remote_code=False)
        self.max_input_len = int(params.get("max_input_len") or 4096)
        # "true": BOS first, as the model's tokenizer encodes a prompt (the repository writes the model's
        # own convention, harp_trt.data.adds_bos); "false": the text's tokens alone
        self.add_special_tokens = params.get("add_special_tokens", "false").lower() == "true"
        eos = [int(t) for t in params.get("eos_token_ids", "").split(",") if t.strip()]
        if not eos and self.tokenizer.eos_token_id is not None:
            eos = [self.tokenizer.eos_token_id]
        self.largest_batch = 0
        self.gen = BatchedGenerator(self.lm, tuple(eos), max_active=int(params.get("max_active") or 0) or None,
                                    max_seq_len=int(params.get("max_seq_len") or 0) or None,
                                    on_decode=self._log_batch, kv_budget=self._kv_budget(params))
        self._log_admission(params)
        self.stop = threading.Event()
        self.worker = threading.Thread(target=self.gen.serve, args=(self.stop,), daemon=True)
        self.worker.start()

    @staticmethod
    def _kv_budget(params):
        from harp_trt.memory import kv_budget_bytes

        text = params.get("kv_budget", "").strip()
        return kv_budget_bytes(text) if text else None

    def _log_admission(self, params):
        """What this model admits at once, in the server log (the repository README says the same
        at the lengths it was written for)."""
        g = self.gen
        at = g.max_seq_len or 4096
        budget = "no KV budget" if g.kv_budget is None else f"KV budget {g.kv_budget} B"
        n = g.admits(at)
        pb_utils.Logger.log_info(
            f"harp[{self.name}]: {budget}, {g.kv_per_token} B of KV per token over {len(self.lm.kv_layers)} KV layers, "
            f"max_active {g.max_active or 'unbounded'}: admits "
            f"{'every request' if n is None else n} sequence(s) of {at} tokens (prompt + max_tokens) at once; "
            "the rest queue")

    def _log_batch(self, size):
        """Each new largest decode batch goes to the server log (Triton counts one execution per
        request here: the batching happens inside this model, so only it can say)."""
        if size > self.largest_batch:
            self.largest_batch = size
            pb_utils.Logger.log_info(f"harp[{self.name}]: largest decode batch so far: {size} sequences "
                                     f"({self.gen.waiting} queued, {self.gen.kv_reserved} B of KV reserved"
                                     + (f", {self.gen.kv.allocated_bytes} B in KV buffers)" if self.gen.kv else ")"))

    def execute(self, requests):
        from harp_trt.errors import HarpError
        from harp_trt.serving import GenerationRequest, SamplingParams

        for request in requests:
            sender = request.get_response_sender()
            try:
                prompt = _scalar(request, "text_input")
                if prompt is None:
                    raise ValueError("text_input is required")
                if prompt == "":  # whitespace is text (its tokens); no tokens at all is refused by submit
                    raise ValueError("text_input is empty")
                stream = bool(_scalar(request, "stream", False))
                exclude = bool(_scalar(request, "exclude_input_in_output", False))
                if stream and not exclude:
                    exclude = True  # streamed responses carry new text only (vLLM backend convention)
                params = SamplingParams.from_json(_scalar(request, "sampling_parameters"))
                ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
                if self.add_special_tokens and self.tokenizer.bos_token_id is not None:
                    ids = [self.tokenizer.bos_token_id] + list(ids)
                if len(ids) > self.max_input_len:
                    raise ValueError(f"prompt has {len(ids)} tokens, over the limit of {self.max_input_len}")
                self.gen.submit(GenerationRequest(np.asarray(ids, dtype=np.int64), params,
                                                  self._emitter(sender, prompt, stream, exclude),
                                                  cancelled=sender.is_cancelled))
            except (ValueError, HarpError) as e:
                msg = e.message if isinstance(e, HarpError) else str(e)
                sender.send(_error_response(msg), flags=FINAL)
        return None

    def _emitter(self, sender, prompt, stream, exclude):
        detok = _Detok(self.tokenizer)
        pieces = []

        def emit(ids, finished, reason):
            if reason is not None and reason.startswith("error"):
                sender.send(_error_response(reason), flags=FINAL)
                return
            if reason == "cancelled":
                sender.send(flags=FINAL)
                return
            delta = detok.push(list(ids), finished)
            if stream:
                if delta or finished:
                    sender.send(_text_response(delta), flags=FINAL if finished else 0)
                return
            pieces.append(delta)
            if finished:
                text = "".join(pieces)
                sender.send(_text_response(text if exclude else prompt + text), flags=FINAL)

        return emit

    def finalize(self):
        self.stop.set()
        self.worker.join(timeout=10)

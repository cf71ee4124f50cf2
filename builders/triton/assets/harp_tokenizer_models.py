"""What the Python-backend models harp-trt writes around a TensorRT-LLM engine (``preprocessing``,
``postprocessing``) share: config.pbtxt's parameters and the tokenizer each one loads. Written beside
each model's ``model.py`` (``1/``), which puts its own folder on ``sys.path`` to import it. It needs
the standard library and transformers only."""
import json
import os


def resolve_dir(path, base):
    """``path`` itself if absolute, else ``base/path``."""
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(base, path))


def load_tokenizer(folder):
    """The tokenizer in ``folder``; a missing pad token is the EOS token (prompts are right-padded)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return tok


def read_parameters(args):
    """The string parameters of the model Triton initializes (``args["model_config"]``, JSON)."""
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def flag(params, name, default="true"):
    """A boolean parameter: "true", "1" or "yes" (any case) is true."""
    return params.get(name, default).lower() in ("true", "1", "yes")


class TokenizerModel:
    """Base of both models' ``TritonPythonModel``: ``initialize`` reads the parameters (``self.params``)
    and the tokenizer of parameter ``tokenizer_dir`` (default ``tokenizer``, relative to ``here``: the
    subclass sets it to its ``model.py``'s folder); ``finalize`` lets it go."""

    here = "."

    def initialize(self, args):
        self.params = read_parameters(args)
        self.tokenizer = load_tokenizer(resolve_dir(self.params.get("tokenizer_dir", "tokenizer"), self.here))

    def finalize(self):
        self.tokenizer = None

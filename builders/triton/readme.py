"""The README.md of each Triton repository kind, and the ``docker run`` line that starts it.

``docker_run`` writes every environment variable as a ``-e VAR=value`` option of ``docker run``:
whatever follows the image is the container's command, so a ``VAR=value`` there would be run as a
program (``docs/trtllm-contract.md``, row triton-docker-env). The image comes from the release
table (``releases.py``): the README names the release and, for TensorRT-LLM, the version it carries.

A TensorRT-LLM repository's README gives two ``docker run`` commands: one that builds the engine in
that image (``build_engine.sh``; until it has run, the ``tensorrt_llm`` model cannot load), and one that
starts the server as TensorRT-LLM's own launcher does (``launch_command``)."""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from .releases import ngc_image

__all__ = ["docker_run", "launch_command", "readme_llm", "readme_onnx", "readme_trtllm"]


def docker_run(image: str, command: str, *, gpus: bool | int, env: dict[str, str] | None = None,
               mounts: tuple[tuple[str, str], ...] = (('"$(pwd)"', "/models"),), shm: str | None = None,
               ports: bool = True) -> str:
    """A ``docker run`` command (continued over lines) that starts ``command`` in ``image``.
    ``gpus``: True = all, an int = that many (``--gpus N``: a bare value is the count, docker CLI
    ``opts/gpus.go``: ``GpuOpts.Set``). Mount sources are shell words as given (``"$(pwd)"``); env
    values are quoted."""
    gpu = "" if gpus is False else f" --gpus {'all' if gpus is True else int(gpus)}"
    opts = ["docker run --rm" + gpu + (f" --shm-size={shm}" if shm else "")
            + (" -p 8000:8000 -p 8001:8001 -p 8002:8002" if ports else "")]
    if env:
        opts.append(" ".join(f"-e {k}={shlex.quote(v)}" for k, v in env.items()))
    opts.append(" ".join(f"-v {src}:{dst}" for src, dst in mounts) + f" {image}")
    return " \\\n  ".join(opts + [command])


def readme_llm(config, info, s: dict[str, Any]) -> str:
    p = s["parameters"]
    return f"""# Triton model repository: `{config.model_name}` (text in, text out; ONNX Runtime inside)

Written by `harp-trt deploy triton` from `{info.path}` ({info.stage or 'folder'}).

```
{config.model_name}/config.pbtxt   backend python, decoupled (streaming), max_batch_size 0
{config.model_name}/1/model.py     generation loop: KV cache in the server, continuous batching
{config.model_name}/1/engine/      {', '.join(s['files'])}, engine.json, tokenizer
client.py                  streaming gRPC client
harp_triton.json           what was written, from which artifact
```

The model speaks the I/O of Triton's vLLM backend: `text_input` (string), optional `stream`
(bool), `sampling_parameters` (JSON string: max_tokens, temperature, top_k, top_p, seed,
stop_token_ids, ignore_eos; default greedy) and `exclude_input_in_output` (bool) -> `text_output`.
Concurrent requests share one decode batch; prompts are limited to {p['max_input_len']} tokens and
prompt + max_tokens to {p['max_seq_len']}.

{_admission_text(p, s.get('admission') or [])}

## Start the server

The Python backend runs `1/model.py` in the Python environment it finds: that environment needs
`harp-trt`, `onnxruntime`{'-gpu' if config.device == 'gpu' else ''} and `transformers` (for example
`pip install harp-trt` in the image, or a conda-pack'ed `EXECUTION_ENV_PATH`). Then

```bash
tritonserver --model-repository=$(pwd)
```

## Call it

```bash
curl -s localhost:8000/v2/models/{config.model_name}/generate \
  -d '{{"text_input": "The capital of France is", "sampling_parameters": "{{\\"max_tokens\\": 32}}"}}'
curl -sN localhost:8000/v2/models/{config.model_name}/generate_stream \
  -d '{{"text_input": "The capital of France is", "stream": true}}'
python client.py "The capital of France is" --max-tokens 32 --url localhost:8001
```
"""


def _admission_text(p: dict[str, str], rows: list[dict]) -> str:
    """How many sequences the model admits at once, as the README says it (``llm_repo.admission``)."""
    cap = f"at most {p['max_active']} sequences" if p.get("max_active", "0") != "0" else "no fixed cap"
    if not p.get("kv_budget"):
        return (f"Admission: {cap}, no KV budget (`--kv-budget` admits by memory); requests beyond it "
                "queue, in arrival order.")
    head = (f"Admission: a KV budget of `{p['kv_budget']}` ({cap}): a request is admitted while the KV of "
            "every admitted sequence at its longest (prompt + max_tokens, kept layers only) fits in it; the "
            "rest queue in arrival order, never refused for lack of room (a request larger than the whole "
            "budget is refused at once).")
    if not rows or rows[0].get("admits") is None:
        return head + " The budget is a share of the memory free at load: the server log says what it admits."
    table = "\n".join(f"| {r['tokens']} | {r['admits']} | {r['dense_admits']} |" for r in rows)
    return (head + "\n\n| tokens per sequence | sequences at once (this engine) | the dense model |\n"
            "|---|---|---|\n" + table)


def readme_onnx(config, info, s: dict[str, Any], has_tokenizer: bool) -> str:
    gpu = config.device == "gpu"
    pruned = s["pruned_layers"]
    harp = (f"HARP-pruned layers {pruned} have no KV cache tensors; the {len(s['kv_layers'])} kept layers "
            f"{s['kv_layers']} do." if pruned else "All layers keep their KV cache (dense graph).")
    tok_note = "" if has_tokenizer else ("\nThe artifact had no tokenizer files: pass `--tokenizer DIR` to "
                                         "client.py.\n")
    return f"""# Triton model repository: `{config.model_name}` (ONNX Runtime)

Written by `harp-trt deploy triton` from `{info.path}` ({info.stage or 'folder'}).
{harp}

```
{config.model_name}/config.pbtxt      backend onnxruntime, max_batch_size 0, weights {'hard-linked' if s['placed_by'] == 'link' else 'copied'}
{config.model_name}/1/{'  '.join(s['files'])}
{config.model_name}/tokenizer/        used by client.py (Triton ignores non-numeric folders)
client.py                     greedy generation over gRPC, KV cache kept by the client
harp_triton.json              what was written, from which artifact
```

## Start the server

With the NGC container of Triton {config.triton_release} (it ships the onnxruntime backend with ONNX
Runtime {s['compat']['triton_onnxruntime']}; this graph needs {s['compat']['graph_needs_onnxruntime']} or newer):

```bash
{docker_run(ngc_image(config.triton_release, "onnx"), "tritonserver --model-repository=/models", gpus=gpu)}
```

or, where `tritonserver` is installed: `tritonserver --model-repository=$(pwd)`.
Instances run on the {'GPU (KIND_GPU, CUDA execution provider)' if gpu else 'CPU (KIND_CPU)'};
`harp-trt deploy triton --device {'cpu' if gpu else 'gpu'}` writes the other kind.

## Call it

```bash
pip install "tritonclient[grpc]" transformers numpy
python client.py "The capital of France is" --max-tokens 32 --url localhost:8001
```
{tok_note}
## Tensors

`max_batch_size` is 0 and every tensor lists its batch dimension: `attention_mask` is
[batch, past+seq] and the KV tensors are [batch, kv_heads, past, head_dim], so requests with
different lengths cannot be concatenated by Triton's batcher, and the cache is the client's state.
Each call sends `input_ids`, `attention_mask`, `position_ids` and `past_key_values.{{i}}.key/value`
and receives `logits` and `present.{{i}}.key/value`, which become the next call's past.

Inputs: {', '.join(f'`{n}`' for n in s['inputs'])}

Outputs: {', '.join(f'`{n}`' for n in s['outputs'])}
"""


def launch_command(world: int, repo: str = "/models") -> tuple[list[str], dict[str, str]]:
    """The tritonserver command and environment for an engine of ``world`` ranks, as TensorRT-LLM's
    launcher builds them (TensorRT-LLM ``triton_backend/scripts/launch_triton_server.py``, read at
    0b06796b; ``docs/trtllm-contract.md``, row triton-launch). Written out rather than calling the script: it
    starts tritonserver with ``subprocess.Popen`` and returns, which would end the container.

    * every rank's server gets ``--disable-auto-complete-config`` and a python-backend shared-memory
      prefix of its own (``get_cmd``);
    * one rank (``world`` 1): tritonserver alone, as ``--no-mpi`` runs it;
    * more (orchestrator mode, the script's ``--multi-model``): one tritonserver under
      ``mpirun --allow-run-as-root -n 1`` with ``TRTLLM_ORCHESTRATOR=1`` and
      ``TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=1`` (``__main__``), so the backend spawns one worker per rank
      (``ModelInstanceState::getParallelConfigFromParams``); and, for Triton releases after 24.06 (every
      release in ``releases.TRITON_TRTLLM``), ``--pinned-memory-pool-byte-size=0``,
      ``--enable-peer-access=false`` and ``--cuda-memory-pool-byte-size=<gpu>:0`` for every GPU the
      container sees (``add_multi_model_config``; the README's container sees exactly ``world``)."""
    server = ["tritonserver", f"--model-repository={repo}"]
    if world <= 1:
        return [*server, "--disable-auto-complete-config", "--backend-config=python,shm-region-prefix-name=prefix0_"], {}
    pools = ["--pinned-memory-pool-byte-size=0", "--enable-peer-access=false",
             *(f"--cuda-memory-pool-byte-size={gpu}:0" for gpu in range(world))]
    cmd = ["mpirun", "--allow-run-as-root", "-n", "1", *server, *pools, "--disable-auto-complete-config",
           "--backend-config=python,shm-region-prefix-name=prefix0_"]
    return cmd, {"TRTLLM_ORCHESTRATOR": "1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "1"}


def _trtllm_runs(info, s: dict[str, Any], env: dict[str, str]) -> tuple[str, str]:
    """(build, serve): the ``docker run`` that builds the engine where ``gpt_model_path`` points, and
    the one that starts the server; both see exactly the engine's GPUs and the same paths."""
    world = int(s["world_size"] or 1)
    engine_dir = str(s["engine_dir"])
    mounts = [(f'"{info.path}"', f'"{info.path}"')]
    if not Path(engine_dir).is_relative_to(info.path):
        mounts.append((f'"{engine_dir}"', f'"{engine_dir}"'))
    build = docker_run(s["image"], shlex.join(["bash", str(info.path / "build_engine.sh"), engine_dir]),
                       gpus=world, mounts=tuple(mounts), ports=False)
    cmd, launch_env = launch_command(world)
    serve = docker_run(s["image"], shlex.join(cmd), gpus=world, env={**launch_env, **env}, shm="2g",
                       mounts=(('"$(pwd)"', "/models"), *mounts))
    return build, serve


def _launch_text(world: int) -> str:
    if world <= 1:
        return ("one tritonserver, started as TensorRT-LLM's `triton_backend/scripts/launch_triton_server.py` starts "
                "it (`get_cmd`: `--disable-auto-complete-config`, a python-backend shared-memory prefix)")
    return (f"orchestrator mode, as TensorRT-LLM's `triton_backend/scripts/launch_triton_server.py --multi-model` "
            f"starts it: one tritonserver under `mpirun -n 1` with `TRTLLM_ORCHESTRATOR=1`, and the backend spawns "
            f"the engine's {world} ranks itself; Triton's pinned and per-GPU CUDA memory pools are 0 and peer access "
            f"is off (`add_multi_model_config`), `--disable-auto-complete-config` (`get_cmd`). The container sees "
            f"exactly the engine's {world} GPUs (`--gpus {world}`), the ones the pool flags name")


def readme_trtllm(config, info, s: dict[str, Any]) -> str:
    v = s["template_values"]
    world = int(s["world_size"] or 1)
    windows = (f"`max_attention_window_size` = `{v['max_attention_window_size']}` (per layer; HARP-pruned "
               "layers attend over one token, so their KV cache holds one block)."
               if v["max_attention_window_size"] else
               "No per-layer attention windows (DeciLM linear layers carry no KV cache at all).")
    kv = ((info.manifest.get("launch") or {}).get("kv_runtime") or {})
    shares = kv.get("shares_env")
    build, serve = _trtllm_runs(info, s, dict([shares.split("=", 1)]) if shares else {})
    if s["engine_built"]:
        engine = f"The engine is built (`{s['engine_dir']}`); to build it again, in the same image:"
    else:
        engine = ("The engine is not built yet, and until it is the `tensorrt_llm` model fails to load. Build it "
                  "first, in the image that will serve it (`build_engine.sh` runs `trtllm-build` on the checkpoint "
                  f"and writes `{s['engine_dir']}`, where `gpt_model_path` points):")
    if shares:
        windows += (f" The KV pool is split between window sizes by `{shares}` (set in the server command below): "
                    "without it TensorRT-LLM 1.2 gives each window size an equal share "
                    "(`BaseKVCacheManager::calculateMaxNumBlocks`), and the full-attention layers lose half the cache.")
    return f"""# Triton model repository: TensorRT-LLM ({s['architecture']})

Written by `harp-trt deploy triton` from `{info.path}`.

```
ensemble/        text_input, max_tokens -> text_output (preprocessing -> tensorrt_llm -> postprocessing)
preprocessing/   Python backend: tokenizer (1/tokenizer), max_tokens clamped to the engine's max_seq_len
tensorrt_llm/    tensorrtllm backend, gpt_model_path = {s['engine_dir']}
postprocessing/  Python backend: detokenizer (1/tokenizer)
                 (both: 1/model.py imports 1/harp_tokenizer_models.py, their shared parameters and tokenizer)
client.py        sends a prompt to the ensemble and prints the reply
harp_triton.json the values of the template keys and where everything came from
```

{windows}
Batching: `{v['batching_strategy']}`, max batch size {v['triton_max_batch_size']},
`kv_cache_free_gpu_mem_fraction` {v['kv_cache_free_gpu_mem_fraction']}, decoupled (streaming) mode
{'on' if v['decoupled_mode'] else 'off'}.

The checkpoint targets **TensorRT-LLM {s['tensorrt_llm_version']}**; Triton {s['triton_release']}'s image
`{s['image']}` carries it ({s['image_source']}). Use this container for `build_engine.sh` and for
serving (an engine runs only with the TensorRT-LLM version that built it; another release:
`harp-trt deploy triton --triton-release YY.MM`, refused when its TensorRT-LLM differs). The engine
and this repository must be visible inside the container at the paths in the configs, so the
artifact is mounted at its own path.

## Build the engine

{engine}

```bash
{build}
```

## Start the server

Run from this folder (it is mounted as `/models`): {_launch_text(world)}.

```bash
{serve}
```

If the engine lives elsewhere, rewrite with `--engine-dir PATH`: both commands then mount that path from the host at the same path.

## Call it

```bash
pip install "tritonclient[grpc]" numpy
python client.py "The capital of France is" --max-tokens 32 --url localhost:8001
```

or over HTTP: `curl -s localhost:8000/v2/models/ensemble/generate -d '{{"text_input": "Hello", "max_tokens": 16}}'`.
"""

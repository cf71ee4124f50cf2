"""harp_trt.llamacpp_runtime reads llama.cpp's KV-size log line (the format string of the
``llama_kv_cache`` constructor, vendor/llama.cpp/src/llama-kv-cache.cpp, rendered here with C's
``%u`` as ``%d``). Running GGUFs through it is tested where the GGUF stage and the bench use it
(tests/test_gguf_deploy.py, tests/test_bench_runtimes.py)."""
from __future__ import annotations

import pytest

from harp_trt.llamacpp_runtime import KvAllocation

FORMAT = "%s: size = %7.2f MiB (%6d cells, %3d layers, %2d/%d seqs), K (%s): %7.2f MiB, V (%s): %7.2f MiB\n"


@pytest.mark.parametrize("total, cells, layers, streams, k, v", [
    (48.0, 16384, 2, 1, ("f16", 24.0), ("f16", 24.0)),
    (6.38, 1024, 30, 4, ("q8_0", 3.19), ("q8_0", 3.19)),
])
def test_kv_line_is_read_from_llama_cpps_format(total, cells, layers, streams, k, v):
    line = FORMAT % ("llama_kv_cache", total, cells, layers, streams, streams, k[0], k[1], v[0], v[1])
    kv = KvAllocation.from_log("llama_context: n_ctx = 16384\n" + line + "llama_context: graph nodes = 1\n")
    assert (kv.total_mib, kv.cells, kv.layers, kv.streams) == (total, cells, layers, streams)
    assert (kv.k_type, kv.k_mib, kv.v_type, kv.v_mib) == (k[0], k[1], v[0], v[1])
    assert kv.bytes == round(total * 2 ** 20) and kv.total_cells == cells * streams  # exact: integers
    assert kv.line == line.rstrip("\n")


def test_no_kv_line_reads_as_none():
    assert KvAllocation.from_log("llama_context: n_ctx = 512\nllama_kv_cache: CPU KV buffer size = 1.00 MiB\n") is None

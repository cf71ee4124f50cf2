"""Streaming safetensors I/O (harp_trt.weights) against the reference ``safetensors`` library: our
files read back with it, its files read with ours, row ranges, planning errors, truncation."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from harp_trt.errors import CorruptWeightsError
from harp_trt.weights import SafetensorsWriter, TensorSpec, WeightReader


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(7, 5, generator=g).to(torch.bfloat16),
            "b.bias": torch.randn(3, generator=g), "c": torch.arange(12, dtype=torch.int64).view(3, 4),
            "d.half": torch.randn(2, 2, 2, generator=g).half(), "e.empty": torch.zeros(0, 4)}


def test_writer_output_reads_back_with_safetensors_in_any_write_order(tmp_path):
    ts = _tensors()
    path = tmp_path / "x.safetensors"
    with SafetensorsWriter(path, [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in ts.items()]) as w:
        for name in reversed(list(ts)):  # out of plan order
            w.write(name, ts[name])
    with safe_open(str(path), "pt") as f:
        assert set(f.keys()) == set(ts)
        for n, t in ts.items():
            assert f.get_tensor(n).equal(t) and f.get_tensor(n).dtype == t.dtype
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert (8 + header_len) % 8 == 0 and json.loads(path.read_bytes()[8:8 + header_len])["__metadata__"]


def test_reader_reads_reference_files_whole_and_by_rows(tmp_path):
    ts = _tensors()
    save_file(ts, str(tmp_path / "model.safetensors"))
    r = WeightReader(tmp_path)
    assert r.names() == sorted(ts)
    for n, t in ts.items():
        assert r.get(n).equal(t) and r.spec(n).shape == tuple(t.shape)
    assert r.get("a.weight", rows=(2, 5)).equal(ts["a.weight"][2:5])
    assert r.get("a.weight", torch.float32).dtype == torch.float32
    assert r.meta("c").device.type == "meta" and r.meta("c").shape == (3, 4)
    assert r.nbytes() == sum(t.numel() * t.element_size() for t in ts.values())
    assert r.nbytes(torch.float32) == sum(t.numel() * (4 if t.is_floating_point() else t.element_size())
                                          for t in ts.values())


def test_writer_refuses_what_was_not_planned(tmp_path):
    spec = [TensorSpec("w", torch.float32, (2, 2))]
    with pytest.raises(ValueError, match="not planned"):
        with SafetensorsWriter(tmp_path / "a.safetensors", spec) as w:
            w.write("v", torch.zeros(2, 2))
    w = SafetensorsWriter(tmp_path / "b.safetensors", spec)
    with pytest.raises(ValueError, match="planned torch.float32"):
        w.write("w", torch.zeros(2, 3))
    with pytest.raises(ValueError, match="never written"):
        w.close()


def test_truncated_file_is_a_typed_error(tmp_path):
    save_file({"w": torch.randn(64, 64)}, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(CorruptWeightsError, match="truncated"):
        WeightReader(tmp_path).get("w")
    with pytest.raises(CorruptWeightsError, match="is not in"):
        WeightReader(tmp_path).get("missing")

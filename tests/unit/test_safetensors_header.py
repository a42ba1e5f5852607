"""``runtime/files.safetensors_header``: a safetensors file's header read with two plain reads, what lies in it
refused with one ValueError (never a huge allocation, never the values read)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from difftrain.runtime.files import safetensors_header


def test_the_header_of_a_file_safetensors_wrote(tmp_path):
    path = tmp_path / "a.safetensors"
    save_file({"w": torch.zeros(3, 4, dtype=torch.bfloat16)}, str(path), metadata={"k": "v"})
    start, header = safetensors_header(path)
    assert header["__metadata__"] == {"k": "v"}
    assert header["w"]["dtype"] == "BF16" and header["w"]["shape"] == [3, 4]
    assert start + header["w"]["data_offsets"][1] == path.stat().st_size


def _raw(path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.parametrize("make, words", [
    (lambda p: p.write_bytes(b"abc"), "shorter than a safetensors header"),
    (lambda p: p.write_bytes(struct.pack("<Q", 2**60) + b"{}"), "claims"),  # no 2**60-byte read attempted
    (lambda p: _raw(p, b"\xff{not json"), "not JSON"),
    (lambda p: _raw(p, b"[1, 2]"), "not a JSON object"),
    (lambda p: _raw(p, json.dumps({"w": {"dtype": "F32", "shape": [2]}}).encode()), "not a safetensors entry"),
    (lambda p: _raw(p, json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode(), b"1234"),
     "ends before its tensors' data"),
])
def test_a_header_that_lies_is_one_value_error(tmp_path, make, words):
    path = tmp_path / "bad.safetensors"
    make(path)
    with pytest.raises(ValueError, match=words):
        safetensors_header(path)

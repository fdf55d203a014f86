"""An adapter's safetensors file read by tokenfleet's own reader (it lets the GIL go while the
bytes come in): the same tensors as safetensors' reader, and a header that lies about its bytes,
or a file cut short, refused with the reason."""

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenfleet.engines.native.lora.files import SafetensorsError, read_tensors, shapes


def test_the_tensors_equal_safetensors_own_reading(tmp_path):
    path = tmp_path / "w.safetensors"
    tensors = {
        "a.lora_A.weight": torch.randn(8, 96),
        "a.lora_B.weight": torch.randn(64, 8).to(torch.bfloat16),
        "empty": torch.empty(0, 4),
    }
    save_file(tensors, str(path), metadata={"format": "pt"})
    got, want = read_tensors(path, 1 << 20), load_file(str(path))
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name])
    assert shapes(path) == {name: tuple(t.shape) for name, t in want.items()}


@pytest.mark.parametrize(
    "entry, why",
    [
        ({"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 60]}, "does not fit its bytes"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [0, 4096]}, "bad entry"),
        ({"dtype": "I8", "shape": [4], "data_offsets": [0, 4]}, "bad entry"),
        ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "bad entry"),
    ],
)
def test_a_header_that_lies_about_its_bytes_is_refused(tmp_path, entry, why):
    header = json.dumps({"t": entry}).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
    with pytest.raises(SafetensorsError, match=why):
        read_tensors(path, 1 << 20)


def test_a_file_cut_short_is_refused(tmp_path):
    path = tmp_path / "cut.safetensors"
    save_file({"t": torch.randn(64, 64)}, str(path))
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(SafetensorsError):
        read_tensors(path, 1 << 20)
    with pytest.raises(SafetensorsError):
        shapes(path)


def test_a_file_larger_than_any_adapter_here_is_refused_unread(tmp_path):
    path = tmp_path / "huge.safetensors"
    save_file({"t": torch.randn(64, 64)}, str(path))
    with pytest.raises(SafetensorsError, match="more than such a file can hold"):
        read_tensors(path, 1024)

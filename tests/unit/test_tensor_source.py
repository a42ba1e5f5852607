"""runtime/tensor_source.py: weights read one tensor at a time from safetensors files, by name and by
the identity of the meta-built network's tensors; a damaged or non-finite file is one line naming it."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from difftrain.runtime import meta_init
from difftrain.runtime.tensor_source import DeferredWeights, TensorSource, check_weight_indexes


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def test_a_meta_built_network_is_read_tensor_by_tensor_through_a_wrappers_renaming(tmp_path):
    real = _net()
    save_file({k: v.half() for k, v in real.state_dict().items()}, tmp_path / "w.safetensors")
    with meta_init.empty_build():
        net = _net()
    deferred = DeferredWeights()
    deferred.add(net, TensorSource.of_files([tmp_path / "w.safetensors"]))
    wrapper = nn.ModuleDict({"inner": net})  # another name for each tensor, as peft's base_layer gives
    readers = deferred.bind(wrapper)
    assert sorted(readers) == sorted(f"inner.{k}" for k in real.state_dict())
    for name, read in readers.items():
        t = read()
        assert t.dtype == torch.float32 and torch.equal(t, real.state_dict()[name.removeprefix("inner.")].half().float())
    assert [n for n, _ in deferred.tensors(net)] == sorted(real.state_dict())


def test_a_mismatched_damaged_or_non_finite_file_is_one_line(tmp_path):
    with meta_init.empty_build():
        net = _net()
    state = _net().state_dict()
    save_file({**state, "0.weight": torch.zeros(4, 5)}, tmp_path / "shape.safetensors")
    with pytest.raises(ValueError, match=r"^first mismatched key '0.weight' \(shape \(4, 5\) in the files"):
        DeferredWeights().add(net, TensorSource.of_files([tmp_path / "shape.safetensors"]))
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 8 + b"{not json")
    with pytest.raises(ValueError, match=r"^cannot read the weights file .*bad.safetensors: "):
        TensorSource.of_files([tmp_path / "bad.safetensors"])
    save_file({**state, "1.bias": torch.tensor([0.0, float("nan")])}, tmp_path / "nan.safetensors")
    with pytest.raises(ValueError, match=r"nan.safetensors: weight 1.bias is not finite"):
        TensorSource.of_files([tmp_path / "nan.safetensors"]).read("1.bias")


def test_a_bin_folder_and_a_checkpoints_weights_are_read_mapped_one_tensor_at_a_time(tmp_path):
    """A diffusers folder's ``.bin`` (and its sharded index) and a state dict nested in a torch file (a checkpoint's
    ``ema.model``), read through ``torch.load(weights_only=True, mmap=True)``: the file's values, each read a copy
    of its own; a legacy (pre-zip) or damaged ``.bin`` is left to its loader (None), a file without a state dict
    there is one line."""
    real = _net()
    state = {k: v.half() for k, v in real.state_dict().items()}
    (tmp_path / "single").mkdir()
    torch.save(state, tmp_path / "single" / "diffusion_pytorch_model.bin")
    (tmp_path / "index").mkdir()
    torch.save({k: v for k, v in state.items() if k.startswith("0.")}, tmp_path / "index" / "a.bin")
    torch.save({k: v for k, v in state.items() if k.startswith("1.")}, tmp_path / "index" / "b.bin")
    weight_map = {k: ("a.bin" if k.startswith("0.") else "b.bin") for k in state}
    (tmp_path / "index" / "diffusion_pytorch_model.bin.index.json").write_text(f'{{"weight_map": {weight_map}}}'.replace("'", '"'))
    torch.save({"format": "x", "ema": {"model": real.state_dict()}}, tmp_path / "ckpt.pt")  # float32: read as it is
    sources = [TensorSource.of_folder(tmp_path / "single"), TensorSource.of_folder(tmp_path / "index"),
               TensorSource.of_torch_files([tmp_path / "ckpt.pt"], at=("ema", "model"))]
    for source in sources:
        assert source.names() == set(state) and source.shapes == {k: tuple(v.shape) for k, v in state.items()}
        first = source.read("0.weight")
        assert first.dtype == torch.float32 and torch.equal(first, state["0.weight"].float() if source is not sources[2]
                                                            else real.state_dict()["0.weight"])
        assert first.untyped_storage().nbytes() == first.numel() * 4  # its own copy, not a view of the mapped file
    torch.save(state, tmp_path / "single" / "diffusion_pytorch_model.bin", _use_new_zipfile_serialization=False)
    assert TensorSource.of_folder(tmp_path / "single") is None
    import zipfile

    with zipfile.ZipFile(tmp_path / "single" / "diffusion_pytorch_model.bin", "w") as z:  # a zip, but no torch file
        z.writestr("x/data.pkl", b"not a pickle")
    assert TensorSource.of_folder(tmp_path / "single") is None
    with pytest.raises(ValueError, match=r"ckpt.pt holds no state dict \(names -> tensors\) at ema.optimizer$"):
        TensorSource.of_torch_files([tmp_path / "ckpt.pt"], at=("ema", "optimizer"))


class _RunsCode:
    """Unpickled, it would create the file ``marker``: what a hostile ``.bin`` carries."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_torch_file_whose_pickle_would_run_code_is_refused_with_one_line_naming_it(tmp_path):
    marker = tmp_path / "ran"
    hostile = tmp_path / "diffusion_pytorch_model.bin"
    torch.save({"conv_in.weight": torch.zeros(2), "payload": _RunsCode(str(marker))}, hostile)
    with pytest.raises(ValueError, match="cannot read the weights file .*diffusion_pytorch_model.bin") as e:
        TensorSource.of_torch_files([hostile])
    assert "\n" not in str(e.value) and not marker.exists()
    assert TensorSource.of_folder(tmp_path) is None and not marker.exists()  # not mapped: left to its loader


def _sharded_folder(folder, outside):
    """A diffusers model folder whose safetensors index names two files: one in the folder, one (``outside``)
    elsewhere; the index file."""
    from safetensors.torch import save_file

    state = _net().state_dict()
    folder.mkdir()
    save_file({k: v for k, v in state.items() if k.startswith("0.")}, folder / "a.safetensors")
    save_file({k: v for k, v in state.items() if k.startswith("1.")}, outside)
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {k: ("a.safetensors" if k.startswith("0.") else "OUT")
                                                for k in state}}))
    return index


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_a_sharded_index_naming_a_file_outside_its_folder_is_refused(tmp_path, where):
    """A weights index whose ``weight_map`` names ``../x`` or an absolute path is refused in one line naming
    the index (it was read from there), by difftrain's reader and before diffusers' or transformers'
    ``from_pretrained`` would read it."""
    outside = tmp_path / "elsewhere.safetensors"
    index = _sharded_folder(tmp_path / "unet", outside)
    name = "../elsewhere.safetensors" if where == "relative" else str(outside)
    index.write_text(index.read_text().replace("OUT", name))
    for check in (TensorSource.of_folder, check_weight_indexes, lambda f: check_weight_indexes(f.parent)):
        with pytest.raises(ValueError, match=rf"^weights index {re.escape(str(index))} names the file "
                                             rf"'{re.escape(name)}', outside its folder") as e:
            check(tmp_path / "unet")
        assert "\n" not in str(e.value)
    (tmp_path / "unet" / "b.safetensors").write_bytes(outside.read_bytes())  # the same, inside: read
    index.write_text(index.read_text().replace(json.dumps(name)[1:-1], "b.safetensors"))
    assert TensorSource.of_folder(tmp_path / "unet").names() == set(_net().state_dict())
    check_weight_indexes(tmp_path / "unet")


@pytest.mark.parametrize("text, says", [
    ("{not json", "not a JSON object with a weight_map"),
    ('{"metadata": {}}', "its weight_map is not a table"),
    ('["a.safetensors"]', "not a JSON object with a weight_map"),
    ('{"weight_map": {"0.weight": 3}}', "its weight_map is not a table"),
    ('{"weight_map": ["a.safetensors"]}', "its weight_map is not a table"),
])
def test_a_malformed_sharded_index_is_one_line_naming_it(tmp_path, text, says):
    index = _sharded_folder(tmp_path / "unet", tmp_path / "b.safetensors")
    index.write_text(text)
    for check in (TensorSource.of_folder, check_weight_indexes):
        with pytest.raises(ValueError, match=rf"^weights index {re.escape(str(index))}: {says}") as e:
            check(tmp_path / "unet")
        assert "\n" not in str(e.value)


def test_a_sharded_text_encoder_whose_index_leaves_its_folder_is_refused_before_transformers_reads_it(tmp_path):
    """transformers' ``from_pretrained`` joins an index's file names to the folder unchecked: a base part whose
    index names a file outside is refused by ``families.base.load_part`` first (it loaded before)."""
    from transformers import CLIPTextModel

    from difftrain.families.base import load_part
    from tests.text_components import tiny_text_model

    part = tmp_path / "base" / "text_encoder"
    tiny_text_model(64).save_pretrained(part, max_shard_size="20KB")
    index = part / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    moved = sorted(set(weight_map.values()))[-1]
    (part / moved).rename(tmp_path / moved)
    index.write_text(json.dumps({**json.loads(index.read_text()),
                                 "weight_map": {k: f"../../{moved}" if v == moved else v for k, v in weight_map.items()}}))
    with pytest.raises(ValueError, match=rf"^weights index {re.escape(str(index))} names the file '../../{moved}', "
                                         "outside its folder"):
        load_part(tmp_path / "base", "text_encoder", CLIPTextModel, "CLIP text encoder")

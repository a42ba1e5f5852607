"""The LoRA base's digest from its files as stored (issue 41 item 5, ``runtime/stored_digest.py``): a family's
base is digested from its safetensors tensors as the files hold them (never an upcast copy), cached by the files'
fingerprint so a second start reads no weight to take it, changed by a changed weight, unchanged by the dtype a
run holds the base in; a record written before (the float32 digest, no ``base_digest_kind``) still resumes and
still refuses another base."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.checkpoints import checkpoint as ckpt  # noqa: E402
from difftrain.config import load_config  # noqa: E402
from difftrain.families import detect  # noqa: E402
from difftrain.models import text as text_digest  # noqa: E402
from difftrain.networks.build import build_network  # noqa: E402
from difftrain.networks.conditioning import Conditioning  # noqa: E402
from difftrain.runtime import stored_digest  # noqa: E402
from difftrain.runtime.tensor_source import TensorSource  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from tests.integration.test_text_train import _captioned_folder  # noqa: E402
from tests.text_components import write_tiny_sd_folder  # noqa: E402

UNET_FILE = Path("unet") / "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("base-digest")
    _captioned_folder(root / "data", n=4, size=16)
    write_tiny_sd_folder(root / "sd")
    return root


def _overrides(root: Path, base: Path, *extra: str) -> list[str]:
    return ["data.num_workers=0", "optim.warmup_steps=1", "train.batch_size=2", "train.log_every_steps=1",
            "train.progress_bar=false", "checkpoint.every_steps=2", "validation.every_steps=0", "text.cache=off",
            "data.resolution=16", f"data.path={root / 'data'}", "data.captions=true", f"model.init_from={base}",
            f"model.text_encoder={base}", f"model.vae={base}", "diffusion.num_timesteps=100", "lora.rank=2",
            "lora.alpha=2", *extra]


def _net(root: Path, base: Path, *extra: str, network: dict | None = None):
    cfg = load_config(None, _overrides(root, base, *extra))
    return build_network(cfg, Conditioning.from_config(cfg, 0), network, init_weights=network is None)


def _legacy(base: Path) -> str:
    """The digest records held before: the base's float32 weights (``models.text.weights_digest``)."""
    return text_digest.weights_digest(detect(base).load_denoiser(base))


def _bf16_copy(src: Path, dst: Path) -> Path:
    """A copy of the base folder ``src`` whose denoiser's file stores bfloat16 weights."""
    import shutil

    shutil.copytree(src, dst)
    tensors = load_file(src / UNET_FILE)
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, dst / UNET_FILE)
    return dst


def test_family_base_digest_is_of_its_files_as_stored_and_cached(bases, monkeypatch, tmp_path):
    monkeypatch.setenv("DIFFTRAIN_CACHE", str(tmp_path / "cache"))
    base = bases / "sd"

    def no_upcast(*args, **kwargs):
        raise AssertionError("the base was digested upcast to float32")

    monkeypatch.setattr("difftrain.networks.lora.weights_digest", no_upcast)  # (the text encoder's: as before)
    monkeypatch.setattr("difftrain.networks.build.tensors_digest", no_upcast)
    net = _net(bases, base)
    record = net.network_record()
    assert record["base_digest_kind"] == "stored" and len(record["base_digest"]) == 64
    # The digest of the file's tensors as stored: every byte of each tensor hashed once, no more.
    source = TensorSource.of_files([base / UNET_FILE])
    read = []
    assert stored_digest.compute(source, on_read=read.append) == record["base_digest"]
    header = stored_digest.json.loads((base / UNET_FILE).read_bytes()[8:8 + int.from_bytes(
        (base / UNET_FILE).read_bytes()[:8], "little")])
    assert sum(read) == sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    assert list((tmp_path / "cache" / "digests").glob("*.json"))
    # A second start reads its digest from the cache: no tensor hashed.
    monkeypatch.setattr(stored_digest, "compute", no_upcast)
    assert _net(bases, base).network_record() == record


def test_digest_changes_with_a_weight_not_with_the_dtype_held(bases, monkeypatch, tmp_path):
    monkeypatch.setenv("DIFFTRAIN_CACHE", str(tmp_path / "cache"))
    import shutil

    base = bases / "sd"
    digest = _net(bases, base).base_digest
    bf16 = _net(bases, base, "train.precision=bf16")
    assert bf16.base_digest == digest  # the run's precision (bf16 frozen) leaves the files' digest alone
    changed = tmp_path / "changed"
    shutil.copytree(base, changed)
    assert _net(bases, changed).base_digest == digest  # the same tensors elsewhere: the same digest (now cached)
    tensors = load_file(changed / UNET_FILE)
    name = min(tensors)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1.0
    save_file(tensors, changed / UNET_FILE)
    assert _net(bases, changed).base_digest != digest  # rewritten in place, the same size: a new mtime_ns, taken again
    # A bf16 file is hashed as stored, 2 bytes a weight (not its float32 upcast).
    source = TensorSource.of_files([_bf16_copy(base, tmp_path / "bf16") / UNET_FILE])
    read = []
    stored_digest.compute(source, on_read=read.append)
    assert sum(read) == 2 * sum(torch.Size(s).numel() for s in source.shapes.values())


def _old_way(path: Path, digest: str) -> None:
    """Rewrite the checkpoint file ``path`` as a run before the stored digest wrote it: the float32 digest
    ``digest`` and no ``base_digest_kind``."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    state["network"].pop("base_digest_kind")
    state["network"]["base_digest"] = digest
    torch.save(state, path)


def test_a_run_recorded_the_old_way_resumes_and_still_refuses_another_base(bases, monkeypatch, tmp_path):
    monkeypatch.setenv("DIFFTRAIN_CACHE", str(tmp_path / "cache"))
    base = bases / "sd"
    cfg = load_config(None, _overrides(bases, base, "train.total_steps=2"))
    train(cfg, tmp_path / "run")
    path = ckpt.find_checkpoint(tmp_path / "run")
    assert ckpt.load_checkpoint(path)["network"]["base_digest_kind"] == "stored"
    _old_way(path, _legacy(base))
    old = ckpt.load_checkpoint(path)["network"]
    assert "base_digest_kind" not in old
    # The old record's check takes the old digest of the same files; the run goes on recording the stored one.
    net = _net(bases, base, network=old)
    assert net.network_record()["base_digest_kind"] == "stored"
    resumed = load_config(None, _overrides(bases, base, "train.total_steps=4"))
    assert train(resumed, tmp_path / "run").step == 4
    latest = ckpt.load_checkpoint(tmp_path / "run")["network"]
    assert latest["base_digest_kind"] == "stored" and latest["base_digest"] == net.base_digest
    # An old record of other weights is still refused, in one line naming both.
    wrong = {**old, "base_digest": "0" * 64}
    with pytest.raises(ValueError, match="not the base this LoRA adapter was trained on"):
        _net(bases, base, network=wrong)
    # A stored record against a changed base is refused too.
    with pytest.raises(ValueError, match="not the base this LoRA adapter was trained on"):
        _net(bases, _bf16_copy(base, tmp_path / "bf16"), network=latest)


def test_checkpoint_schema_refuses_an_unknown_digest_kind(bases, tmp_path):
    state = {"network": {"kind": "lora", "base": {}, "lora": {}, "base_digest": "0" * 64,
                         "base_digest_kind": "md5"}}
    check = ckpt.SCHEMA["network"][0]
    assert not check(state["network"])
    assert check({**state["network"], "base_digest_kind": "stored"})
    assert check({k: v for k, v in state["network"].items() if k != "base_digest_kind"})

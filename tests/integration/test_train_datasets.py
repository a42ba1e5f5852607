"""Training on tar shards and a Hugging Face dataset: a resumed run equals the straight one."""

from __future__ import annotations

from tests.integration.test_train import assert_resume_is_exact
from tests.unit.test_datasets import hf_dataset, needs_hf, write_folder, write_shards


def test_resume_on_tar_shards_is_exact(tmp_path, tiny_overrides):
    names = write_folder(tmp_path / "folder", n=20)
    (tmp_path / "folder" / names[4]).write_bytes(b"broken")  # skipped mid-run, the same way both times
    pattern = write_shards(tmp_path / "folder", tmp_path / "shards", names, per_shard=6)
    assert_resume_is_exact(tmp_path, tiny_overrides + [
        f"data.path={pattern}", "data.num_workers=1", "data.class_conditional=true", "data.on_bad_image=skip"])
    assert "mid-run" in (tmp_path / "resumed" / "bad_images.log").read_text()


@needs_hf
def test_resume_on_a_parquet_dataset_is_exact(tmp_path, tiny_overrides):
    names = write_folder(tmp_path / "folder", n=20)
    hf_dataset(tmp_path / "folder", names).to_parquet(str(tmp_path / "train.parquet"))
    assert_resume_is_exact(tmp_path, tiny_overrides + [
        f"data.path={tmp_path / 'train.parquet'}", "data.class_conditional=true", "data.label_column=label",
        "data.heldout_fraction=0.2"])

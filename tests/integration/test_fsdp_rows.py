"""Under FSDP each rank reads only its rows of the base (issue 41 item 5, ``fsdp.fill_shard_from``): on 2 gloo
CPU processes, SD's UNet in full and as a LoRA base (from safetensors) and from a ``.bin`` folder (mapped), each
rank's reads of the base's files, counted at ``TensorSource.read``, add up to the base once over both ranks (no
rank reads the whole), and the state built is bit for bit the whole build's (``builds_sharded`` forced False),
so training from it is unchanged."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from multiproc import run_ranks  # noqa: E402

from tests.integration.test_fsdp_meta_bases import BUILD, _bin_folder, _built, _same_as_whole  # noqa: E402


def _counted(ctx, runs: list[list[str]]) -> dict:
    """``_built`` of ``runs`` on this rank, with the elements its sharded builds read from the base's files."""
    import difftrain.training.state as state_module
    from difftrain.runtime.tensor_source import TensorSource

    read, counts = TensorSource.read, []
    sharded = state_module.builds_sharded

    def counting(self, name, rows=None):
        t = read(self, name) if rows is None else read(self, name, rows)
        if state_module.builds_sharded is sharded:  # the sharded build's reads, not the whole build's
            counts[-1] += t.numel()
        return t

    TensorSource.read = counting
    results = []
    for overrides in runs:
        counts.append(0)
        results.append(_built(ctx, [overrides])[0])
    TensorSource.read = read
    return {"built": results, "read": counts}


def test_each_fsdp_rank_reads_only_its_rows_of_the_base(tmp_path):
    from safetensors import safe_open

    from tests.text_components import write_tiny_sd_folder

    sd = write_tiny_sd_folder(tmp_path / "sd")
    sd_bin = _bin_folder(sd, tmp_path / "sd_bin")
    with safe_open(str(sd / "unet" / "diffusion_pytorch_model.safetensors"), framework="pt") as f:
        base = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 - a safe_open
    runs = [[*BUILD, f"model.init_from={sd}"], [*BUILD, f"model.init_from={sd}", "lora.rank=2"],
            [*BUILD, f"model.init_from={sd_bin}"]]
    rank0, rank1 = run_ranks(_counted, 2, runs, timeout_s=900)
    for i in range(len(runs)):
        _same_as_whole([rank0["built"][i]])  # the whole build's weights, EMA, record: bit for bit
        assert rank0["read"][i] + rank1["read"][i] == base, (i, rank0["read"], rank1["read"], base)
        assert max(rank0["read"][i], rank1["read"][i]) < 0.6 * base, (i, rank0["read"], rank1["read"], base)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _build_error(ctx, overrides: list[str]) -> str:
    """The ValueError ``RunState.build`` ends with on this rank (sharded from the files), or "" if none."""
    from difftrain.config import load_config
    from difftrain.training.state import RunState

    try:
        RunState.build(load_config(None, overrides), 0, ctx.device, dctx=ctx)
    except ValueError as e:
        return str(e)
    return ""


def test_a_weight_not_finite_in_one_ranks_rows_ends_every_rank(tmp_path):
    """A NaN in the last row of the base's largest weight lies in rank 1's rows alone: rank 1's error names the
    file, and rank 0 ends with one too (naming rank 1) instead of waiting at its next collective."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.text_components import write_tiny_sd_folder

    sd = write_tiny_sd_folder(tmp_path / "sd")
    bad = tmp_path / "bad"
    shutil.copytree(sd, bad)
    weights = bad / "unet" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(weights))
    name = max((k for k, t in tensors.items() if t.dim() >= 2 and t.is_floating_point()), key=lambda k: tensors[k].shape[0])
    tensors[name][-1].fill_(float("nan"))
    save_file(tensors, str(weights))
    rank0, rank1 = run_ranks(_build_error, 2, [*BUILD, f"model.init_from={bad}"], timeout_s=600, collective_timeout_s=120)
    assert "not finite" in rank1 and "diffusion_pytorch_model.safetensors" in rank1, rank1
    assert "not finite" in rank0 and "rank 1" in rank0, rank0

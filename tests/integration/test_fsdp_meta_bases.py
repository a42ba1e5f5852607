"""FSDP's sharded start from a base's files on 2 gloo CPU processes: a base family's denoiser (SD's
UNet2DConditionModel, SDXL's, SD3's and Flux's transformers; SD's from a ``.bin`` folder too), a LoRA network
on it (its adapter started from ``model.init_lora_from`` too; a base saved under names diffusers renames on
load too), and difftrain's UNet from a ``model.init_from`` weights file or checkpoint (``.pt``), each built on
the meta device, sharded, and filled one tensor at a time from the files (safetensors, or torch's zip files
mapped by ``torch.load(mmap=True)``), or from a sharded checkpoint's folder each rank's part -- the same
weights, adapter start, record and base digest as the whole build it replaces (``builds_sharded`` forced
False), and a LoRA's resume reads its base so too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from conftest import TINY_OVERRIDES  # noqa: E402
from multiproc import reset_peak, run_ranks, status_bytes  # noqa: E402

from difftrain.config import load_config  # noqa: E402

BUILD = [*TINY_OVERRIDES, "train.device=cpu", "train.channels_last=off", "train.parallel=fsdp", "ema.posthoc_std=[0.1]"]


def _built(ctx, runs: list[list[str]]) -> list[dict]:
    """For each config of ``runs``, the state ``RunState.build`` makes on this rank sharded from the files,
    then whole and sharded after (``builds_sharded`` forced False): every weight gathered whole, the
    EMA's, the network's record, the names of what trains."""
    import difftrain.checkpoints.checkpoint as checkpoint_module
    import difftrain.training.state as state_module
    from difftrain.networks.build import network_record
    from difftrain.training.state import RunState

    out, consolidated = [], []
    whole_read = checkpoint_module.load_consolidated
    checkpoint_module.load_consolidated = lambda path: consolidated.append(path) or whole_read(path)
    for overrides in runs:
        both = {}
        for sharded in (True, False):
            if not sharded:
                saved, state_module.builds_sharded = state_module.builds_sharded, lambda *args, **kwargs: False
            cfg = load_config(None, overrides)
            consolidated.clear()
            state = RunState.build(cfg, 0, ctx.device, dctx=ctx)
            built_sharded = state.template is not None
            state.parallelize(ctx)
            whole, ema = state.gathered_models()
            both[sharded] = {"sharded": built_sharded, "consolidated": len(consolidated), "weights": nn.Module.state_dict(whole),
                             "ema": nn.Module.state_dict(ema), "record": network_record(state.model),
                             "trains": sorted(n for n, p in state.model.named_parameters() if p.requires_grad)}
            if not sharded:
                state_module.builds_sharded = saved
        out.append(both)
    return out


def _same_as_whole(results: list[dict]) -> list[dict]:
    """Each config built sharded from its files equals its whole build, bit for bit (rank 0's)."""
    out = []
    for both in results:
        new, old = both[True], both[False]
        assert new["sharded"] and not old["sharded"]
        assert new["record"] == old["record"] and new["trains"] == old["trains"]
        for key in ("weights", "ema"):
            assert new[key].keys() == old[key].keys()
            assert all(torch.equal(new[key][k], old[key][k]) for k in new[key]), key
        out.append(new)
    return out


def _perturbed(state: dict, seed: int) -> dict:
    """``state`` (a run state's ``state_dict``) with its EMA weights moved by noise, in place: not the
    zero-initialised output layer or LoRA B."""
    torch.manual_seed(seed)
    for v in state["ema"]["model"].values():
        v.add_(0.01 * torch.randn_like(v)) if v.is_floating_point() else None
    return {**state, "path": "base"}


def _bin_folder(sd: Path, out: Path) -> Path:
    """A copy of the SD folder ``sd`` whose UNet's weights are a ``.bin`` (torch's zip pickle), as older
    diffusers and many hub folders hold them."""
    import shutil

    from safetensors.torch import load_file

    shutil.copytree(sd, out)
    unet = out / "unet" / "diffusion_pytorch_model.safetensors"
    torch.save(load_file(unet), unet.with_suffix(".bin"))
    unet.unlink()
    return out


# The attention names diffusers renames on load (blocks saved before diffusers 0.15), as such a file holds them.
_LEGACY_ATTENTION = {".to_q.": ".query.", ".to_k.": ".key.", ".to_v.": ".value.", ".to_out.0.": ".proj_attn."}


def write_legacy_unet_folder(path: Path) -> Path:
    """A bare UNet2DConditionModel folder (SD's family) with plain attention blocks (``AttnDownBlock2D``,
    ``AttnUpBlock2D``: diffusers' deprecated-attention blocks) whose weights file holds their old names
    (``query``, ``key``, ``value``, ``proj_attn``), which ``from_pretrained`` renames as it loads."""
    from diffusers import UNet2DConditionModel
    from safetensors.torch import load_file, save_file

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
            norm_num_groups=32, attention_head_dim=8, down_block_types=("AttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "AttnUpBlock2D"), cross_attention_dim=32,
        ).save_pretrained(path)
    weights = path / "diffusion_pytorch_model.safetensors"
    tensors, renamed = load_file(weights), {}
    for name, t in tensors.items():
        if name.startswith(("down_blocks.0.attentions.", "up_blocks.1.attentions.")):
            for new, old in _LEGACY_ATTENTION.items():
                name = name.replace(new, old)
        renamed[name] = t
    assert len({k for k in renamed if ".query." in k}) == 3 * 2  # three blocks' weight and bias
    save_file(renamed, weights)
    return path


def _sharded_checkpoint(state: dict, root: Path) -> Path:
    """The sharded checkpoint folder (``step_00000000.dcp``) an FSDP run would write of ``state`` (a run
    state's ``state_dict``), written in this process (one shard file) by the FSDP save path."""
    import warnings

    from difftrain.config import config_from_dict
    from difftrain.runtime import distributed
    from difftrain.checkpoints import sharded as sharded
    from difftrain.training.state import RunState

    cpu = torch.device("cpu")
    run_state = RunState.build(config_from_dict(state["config"]), state["num_classes"], cpu, init_weights=False)
    run_state.load_state_dict(state)
    with warnings.catch_warnings():  # DCP without a process group: "assuming ... a single process"
        warnings.simplefilter("ignore", UserWarning)
        return sharded.save_or_report(run_state, run_state.state_dict(), root, 0, 3, 0, "stop", distributed.setup(cpu, 60))


def _lora_files(sd: Path, root: Path) -> tuple[Path, Path]:
    """(difftrain's own export, another program's file: diffusers' layout without difftrain's record) of a
    rank-2, alpha-4 adapter on ``sd``, its B not zero."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from difftrain.interop.adapters import export_lora
    from difftrain.networks.lora_import import ADAPTER_KEY, DIFFUSERS_WEIGHT_NAME
    from difftrain.training.state import RunState

    cfg = load_config(None, [*TINY_OVERRIDES, "train.device=cpu", f"model.init_from={sd}", "lora.rank=2", "lora.alpha=4"])
    state = _perturbed(RunState.build(cfg, 0, torch.device("cpu")).state_dict(), 2)
    own = export_lora(state, root / "own", layout="difftrain")
    theirs = export_lora(state, root / "theirs", layout="diffusers") / DIFFUSERS_WEIGHT_NAME
    with safe_open(str(theirs), framework="pt") as f:
        metadata = {k: v for k, v in f.metadata().items() if k != ADAPTER_KEY}
    save_file(load_file(theirs), theirs, metadata=metadata)
    return own, theirs


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> list[dict]:
    """The eighteen builds, each both ways, on 2 ranks in one spawn (about 100 s on a busy 2-core machine):
    SD's UNet in full and with LoRA, Flux's transformer with LoRA, difftrain's UNet from a weights file
    in full and as a LoRA base (with its convolutions), SDXL's UNet and SD3's transformer in full and
    with LoRA; SD's UNet from a ``.bin`` folder in full and with LoRA started from another program's LoRA
    file (its alpha folded), SD's LoRA started from difftrain's own export, difftrain's UNet from a
    checkpoint file in full and as a LoRA base; difftrain's UNet from a sharded checkpoint's folder (in full and
    as a LoRA base); a UNet
    whose weights file holds attention names diffusers renames on load, in full and as a LoRA base."""
    from difftrain.checkpoints.weights_file import save_weights_file
    from difftrain.checkpoints.checkpoint import save_checkpoint_file
    from difftrain.training.state import RunState
    from tests.family_bases import write_tiny_flux_folder, write_tiny_sd3_folder, write_tiny_sdxl_folder
    from tests.text_components import write_tiny_sd_folder

    root = tmp_path_factory.mktemp("bases")
    sd, flux = write_tiny_sd_folder(root / "sd"), write_tiny_flux_folder(root / "flux")
    sdxl, sd3 = write_tiny_sdxl_folder(root / "sdxl"), write_tiny_sd3_folder(root / "sd3")
    state = _perturbed(RunState.build(load_config(None, [*TINY_OVERRIDES, "train.device=cpu"]), 0,
                                      torch.device("cpu")).state_dict(), 1)
    weights = save_weights_file(state, root / "base.safetensors")
    save_checkpoint_file({k: v for k, v in state.items() if k != "path"}, root / "base.pt")
    sd_bin, (own, theirs) = _bin_folder(sd, root / "sd_bin"), _lora_files(sd, root)
    dcp, legacy = _sharded_checkpoint(state, root / "checkpoints"), write_legacy_unet_folder(root / "legacy")
    runs = [[*BUILD, f"model.init_from={sd}"], [*BUILD, f"model.init_from={sd}", "lora.rank=2"],
            [*BUILD, f"model.init_from={flux}", "lora.rank=2"], [*BUILD, f"model.init_from={weights}"],
            [*BUILD, f"model.init_from={weights}", "lora.rank=2", "lora.include_conv=true"],
            [*BUILD, f"model.init_from={sdxl}"], [*BUILD, f"model.init_from={sdxl}", "lora.rank=2"],
            [*BUILD, f"model.init_from={sd3}"], [*BUILD, f"model.init_from={sd3}", "lora.rank=2"],
            [*BUILD, f"model.init_from={sd_bin}"],
            [*BUILD, f"model.init_from={sd_bin}", "lora.rank=2", f"model.init_lora_from={theirs}"],
            [*BUILD, f"model.init_from={sd}", "lora.rank=2", "lora.alpha=4", f"model.init_lora_from={own}"],
            [*BUILD, f"model.init_from={root / 'base.pt'}"], [*BUILD, f"model.init_from={root / 'base.pt'}", "lora.rank=2"],
            [*BUILD, f"model.init_from={dcp}"], [*BUILD, f"model.init_from={legacy}"],
            [*BUILD, f"model.init_from={legacy}", "lora.rank=2"], [*BUILD, f"model.init_from={dcp}", "lora.rank=2"]]
    return run_ranks(_built, 2, runs, timeout_s=1500)[0]


def test_an_sd_denoiser_and_its_lora_start_sharded_from_the_base_files(built):
    """SD's UNet (full fine-tuning) and a LoRA on it (rank 2, gaussian start: A drawn, B zero): the
    whole build's weights, adapter and record (the base's digest, read one tensor at a time)."""
    full, lora = _same_as_whole(built[:2])
    assert full["record"]["kind"] == "family" and full["trains"]
    assert lora["record"]["kind"] == "lora" and len(lora["record"]["base_digest"]) == 64
    assert lora["trains"] and all("lora_" in n for n in lora["trains"])


def test_a_flux_transformer_with_lora_starts_sharded_from_its_files(built):
    (lora,) = _same_as_whole(built[2:3])
    assert lora["record"]["base"]["family"] == "flux"


def test_difftrains_unet_from_a_weights_file_starts_sharded_from_it(built):
    """``model.init_from`` a difftrain weights file, full fine-tuning and as a LoRA base (include_conv)."""
    full, lora = _same_as_whole(built[3:5])
    assert full["record"] == {"kind": "unet"} and lora["record"]["kind"] == "lora"


@pytest.mark.parametrize("family, at", [("sdxl", 5), ("sd3", 7)])
def test_sdxl_and_sd3_denoisers_and_their_loras_start_sharded_from_their_files(built, family, at):
    """SDXL's UNet (its added time / text embedding) and SD3's transformer (its position table, a buffer),
    in full and with LoRA: the generic family path, the whole build's weights, EMA, adapter and record."""
    full, lora = _same_as_whole(built[at:at + 2])
    assert full["record"]["kind"] == "family" and full["record"]["family"] == family
    assert lora["record"]["kind"] == "lora" and lora["record"]["base"]["family"] == family
    assert len(lora["record"]["base_digest"]) == 64 and all("lora_" in n for n in lora["trains"])


def test_a_bin_folder_a_checkpoint_and_a_lora_file_to_start_from_are_read_sharded_too(built):
    """SD's UNet from a ``.bin`` folder (mapped, read one tensor at a time) in full and as the base of a LoRA
    whose adapter starts from another program's file (diffusers' layout, alpha 4 folded into B at this run's
    alpha 2), a LoRA started from difftrain's own export, difftrain's UNet from a checkpoint file's EMA
    weights in full and as a LoRA base: each the whole build, bit for bit; the adapters start from the
    files (B not zero)."""
    full_bin, lora_bin, lora_own, full_pt, lora_pt = _same_as_whole(built[9:14])
    assert full_bin["record"]["kind"] == "family" and full_pt["record"] == {"kind": "unet"}
    for lora in (lora_bin, lora_own):
        assert any("lora_B" in k and v.abs().max() > 0 for k, v in lora["weights"].items())
    assert lora_pt["record"]["kind"] == "lora" and len(lora_pt["record"]["base_digest"]) == 64
    assert lora_bin["record"]["base_digest"] == built[1][True]["record"]["base_digest"]  # the .bin holds SD's weights


def write_sd_unet_folder(path: Path, channels: int) -> Path:
    """A bare UNet2DConditionModel folder (SD's family), two levels of ``channels`` and twice that, two
    ResNets a level, cross-attention of width 32: 17.4M parameters at 128 channels, 39.0M at 192."""
    from diffusers import UNet2DConditionModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(channels, 2 * channels),
            norm_num_groups=32, attention_head_dim=8, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        ).save_pretrained(path)
    return path


def start_up_peaks(ctx, runs: list[list[str]]) -> list[dict]:
    """For each config of ``runs``, this rank's peak RSS above its start while ``RunState.build`` and
    ``parallelize`` make the sharded state: from the files (``sharded``), then whole and sharded after
    (``whole``); freed memory given back between them. Also the parameter count."""
    import difftrain.training.state as state_module
    from difftrain.training.state import RunState

    out, sharded_build = [], state_module.builds_sharded
    for overrides in runs:
        cfg, peaks = load_config(None, overrides), {}
        for name, builds in (("sharded", sharded_build), ("whole", lambda *args, **kwargs: False)):
            state_module.builds_sharded = builds
            start = reset_peak(give_back=True)
            state = RunState.build(cfg, 0, ctx.device, dctx=ctx)
            state.parallelize(ctx)
            peaks[name] = status_bytes("VmHWM") - start
            peaks["params"] = sum(p.numel() for p in state.template.parameters())
            del state
        state_module.builds_sharded = sharded_build
        out.append(peaks)
    return out


def test_a_ranks_start_up_from_a_base_holds_no_whole_copy(tmp_path, monkeypatch):
    """An SD-shaped UNet2DConditionModel of 17.4M parameters (66 MiB of fp32 weights) on 2 ranks, in full
    (weights, EMA, one post-hoc EMA) and with LoRA (its frozen base shared by the EMA). Each rank's
    start-up peak from the files stays under the whole weights (LoRA) and under the whole weights, EMA
    and post-hoc EMA (full: its shards are 6 bytes per parameter; measured 8.0, the fixed costs weigh
    more at this size than at 39M, 6.9); the whole build it replaced holds more than either. glibc's mmap
    threshold is fixed, so that RSS counts live memory (tests/integration/test_fsdp_lockstep_eval.py)."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    unet = write_sd_unet_folder(tmp_path / "unet", 128)
    runs = [[*BUILD, f"model.init_from={unet}"], [*BUILD, f"model.init_from={unet}", "lora.rank=4"]]
    for full, lora in run_ranks(start_up_peaks, 2, runs):
        weights = 4 * full["params"]
        assert full["sharded"] < 3 * weights < full["whole"], (full, lora, weights)  # 3: weights, EMA, post-hoc EMA
        assert lora["sharded"] < weights < lora["whole"], (full, lora, weights)


def test_difftrains_unet_from_a_sharded_checkpoint_reads_each_ranks_part_into_its_shards(built):
    """``model.init_from`` a sharded checkpoint's folder (``step_N.dcp``, the same EMA weights as the checkpoint
    file of the runs above): the whole build, bit for bit, with each rank's part read by
    ``torch.distributed.checkpoint.load`` straight into its shards -- never read consolidated
    (``load_consolidated``), as the whole build reads it; and as a LoRA base."""
    (full, lora) = _same_as_whole([built[14], built[17]])
    assert full["record"] == {"kind": "unet"} and full["consolidated"] == 0 and built[14][False]["consolidated"] == 1
    from_file = built[12][True]["weights"]  # the checkpoint file holding the same EMA weights
    assert all(torch.equal(full["weights"][k], from_file[k]) for k in from_file)
    # As a LoRA base (its digest and its shards: one whole tensor at a time, each read alone by dcp.load),
    # never read consolidated either: the base of the checkpoint file's LoRA, digest for digest.
    assert lora["consolidated"] == 0 and lora["record"]["base_digest"] == built[13][True]["record"]["base_digest"]


def test_a_base_saved_under_names_diffusers_renames_is_read_sharded_under_the_new_names(built):
    """A UNet2DConditionModel whose file holds the pre-0.15 attention names (``query``, ``proj_attn``...),
    in full and as a LoRA base: built sharded (not whole with a warning), each weight read under the name
    ``from_pretrained`` gives it (diffusers' own renaming, run on the names): the whole build, bit for bit,
    the LoRA base's digest included."""
    full, lora = _same_as_whole(built[15:17])
    assert full["record"]["kind"] == "family" and any(".to_q." in k and "attentions" in k for k in full["weights"])
    assert lora["record"]["kind"] == "lora" and len(lora["record"]["base_digest"]) == 64

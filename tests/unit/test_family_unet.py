"""difftrain's own UNet as a family (families/unet.py): what family_of_config / family_of_record answer
for every run and record that is no base family's, and its parts, condition, LoRA targets and export kind."""

import pytest
import torch

from difftrain.config import load_config
from difftrain.data.text_cache import cached_prompt_encoder
from difftrain.families import FAMILIES, UNET, detect, family_named, family_of_config, family_of_record
from difftrain.interop.diffusers import EXPORTS
from difftrain.networks.conditioning import Conditioning
from difftrain.networks.lora import ATTENTION_TARGETS


def test_every_config_and_record_without_a_base_answers_the_unet_family(tmp_path):
    weights = tmp_path / "model.safetensors"
    assert family_of_config(load_config(None, []).model) is UNET  # from scratch
    assert family_of_config(load_config(None, [f"model.init_from={weights}"]).model) is UNET  # a weights file
    assert family_of_config(load_config(None, ["model.family=", f"model.init_from={tmp_path}"]).model) is UNET
    assert family_of_record({"kind": "unet"}) is UNET and family_of_record(None) is UNET  # old checkpoints: no record
    assert family_of_record({"kind": "family", "family": "sd", "config": {}}).name == "sd"


def test_the_unet_family_is_registered_but_no_base():
    assert FAMILIES["unet"] is UNET and not UNET.base
    with pytest.raises(ValueError, match=r"^model.family must be one of flux, flux2, flux2-klein, sd, sd3, sdxl \(or auto\), got 'unet'$"):
        family_named("unet")


def test_no_folder_is_detected_as_the_unet_family(tmp_path):
    (tmp_path / "config.json").write_text('{"_class_name": ""}')
    with pytest.raises(ValueError, match="supported: sd \\(StableDiffusionPipeline\\), sdxl") as info:
        detect(tmp_path)
    assert "unet" not in str(info.value)


def test_the_unet_family_says_what_the_callers_used_to_branch_on():
    assert UNET.lora_targets == ATTENTION_TARGETS["unet"]  # the default targets of a {"kind": "unet"} record
    assert not UNET.diffusers_lora and UNET.cuda_graphs and UNET.export_kind in EXPORTS
    assert all(f.diffusers_lora and not f.cuda_graphs and f.export_kind in EXPORTS
               for f in FAMILIES.values() if f.base)
    assert UNET.training_defaults(None) == {} and UNET.native_resolution(None) is None


def test_a_text_unet_runs_conditions_through_its_family():
    cfg = load_config(None, ["model.text_encoder=builtin:tiny-clip", "data.captions=true"])
    c = Conditioning.from_config(cfg)
    assert c.family is UNET and Conditioning().family is UNET
    cond = c.condition(["a dog", "a cat"], torch.tensor([True, False]), torch.device("cpu"))
    null = c.null(2)
    assert cond.shape == null.shape == (2, c.text.max_length, c.context_dim)
    assert torch.equal(cond[0], null[0]) and not torch.equal(cond[1], null[1])  # the dropped row is the null's
    assert torch.equal(c.prompts(["a cat"])[0], cond[1])


def test_the_unet_family_refuses_the_text_cache_on():
    cfg = load_config(None, ["model.text_encoder=builtin:tiny-clip", "data.captions=true", "text.cache=on"])
    with pytest.raises(ValueError, match=r"^text.cache='on' caches a base family's text encoders .* is difftrain's own"):
        UNET.run_prompt_encoder(cfg, "cpu", cached_prompt_encoder)
    assert UNET.run_prompt_encoder(cfg, "cpu").source == "builtin:tiny-clip"  # without the cache: loaded

"""The run state: everything a run carries from one optimizer step to the next, and the
checkpoint it becomes (the keys of ``checkpoint.SCHEMA``).

    state = RunState.build(cfg, num_classes, device)      # fresh weights from the run's seed
    state.load_state_dict(load_checkpoint(path))           # or where a checkpoint left off
    state.state_dict()                                     # what save_checkpoint writes

Under FSDP (``train.parallel = "fsdp"`` on several ranks) ``build(..., dctx=dctx)`` never holds a
whole copy: the network is built on the meta device and sharded before its weights exist, then
filled shard by shard (``runtime/fsdp.py``), and ``load_resume`` + ``load_state_dict`` read a
sharded checkpoint's run state first and its shards into the sharded state
(``sharded.load_shards``).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from difftrain.checkpoints import sharded as sharded
from difftrain.checkpoints.checkpoint import find_checkpoint, load_checkpoint, load_weights
from difftrain.config import Config, ModelConfig, OptimConfig, TrainConfig, allowed_changes, config_to_dict, incompatible_keys, unknown_keys
from difftrain.networks.block_swap import BlockSwap, swap_base
from difftrain.networks.build import build_network, network_record
from difftrain.networks.conditioning import Conditioning
from difftrain.networks.frozen_dtype import frozen_dtype, gathered_in_compute_dtype, hold_frozen
from difftrain.networks.lora import resume_mismatch as lora_mismatch
from difftrain.runtime import distributed, fsdp, meta_init
from difftrain.runtime.device import prepare_model
from difftrain.runtime.distributed import DistContext
from difftrain.runtime.precision import Precision
from difftrain.runtime.seeding import derive_seed, rng_state, set_rng_state
from difftrain.runtime.tensor_source import DeferredWeights
from difftrain.training.ema import EMA
from difftrain.training.ema import is_view as ema_is_view
from difftrain.training.optimizers import build_optimizer, reading_weights, to_training
from difftrain.training.optimizers import resume_mismatch as optimizer_mismatch
from difftrain.training.power_ema import PowerEMA


def effective_batch(tc: TrainConfig, world_size: int = 1) -> int:
    """Images per optimizer step of the train section ``tc``: per-device batch x accumulation x world size."""
    return tc.batch_size * tc.grad_accum_steps * world_size


def peak_lr(o: OptimConfig, images_per_step: int) -> float:
    """``optim.lr`` of the optim section ``o``, scaled by the linear rule (Goyal et al. 2017) to
    ``images_per_step`` (:func:`effective_batch`) when ``optim.scale_lr``."""
    if not o.scale_lr:
        return o.lr
    return o.lr * images_per_step / o.base_batch


@dataclasses.dataclass
class RunState:
    """Model, EMA, optimizer, loss scale, step, data position and counters of one run; with
    ``ema.posthoc_std``, the power-function EMAs of post-hoc EMA (none: a no-op).

    ``model`` is the unwrapped network: the one saved, averaged by the EMA and loaded into;
    ``net`` is the same weights as they run forward and backward (DDP-wrapped and compiled
    where those are on), set by the training loop and never saved.
    """

    cfg: Config
    model: nn.Module
    ema: EMA
    optimizer: torch.optim.Optimizer
    precision: Precision
    posthoc: PowerEMA
    num_classes: int = 0
    conditioning: Conditioning | None = None  # labels or text, and the frozen text encoder and VAE
    step: int = 0  # optimizer steps taken
    position: int = 0  # images consumed by all ranks together: the global data position
    skipped_steps: int = 0  # steps skipped for a non-finite loss or gradient, as of the last log
    net: nn.Module | None = None
    template: nn.Module | None = None  # under FSDP: the model's structure on the meta device (runtime/fsdp.py)
    dctx: DistContext | None = None  # the ranks a sharded state spans (build with dctx)
    swap: BlockSwap | None = None  # model.swap_blocks: the plan ``parallelize`` installed (networks/block_swap.py)

    @classmethod
    def build(cls, cfg: Config, num_classes: int, device: torch.device, init_weights: bool = True,
              conditioning: Conditioning | None = None, network: dict | None = None,
              dctx: DistContext | None = None) -> RunState:
        """Fresh weights from the run's seed (the same on every rank), on ``device``; with
        ``model.init_from`` and ``init_weights``, the weights it names instead (a resume, which
        loads its checkpoint over them, passes False and the checkpoint's ``network``). The network
        itself is made by ``networks/build.py`` (:func:`~difftrain.networks.build.build_network`, one call).

        conditioning: the run's labels or text and frozen parts (default: ``num_classes`` labels).
        dctx: under FSDP (:func:`builds_sharded`), the state is built sharded across its ranks
        without a whole copy anywhere (:meth:`_build_sharded`); ``parallelize`` then leaves it as it is.
        """
        tc = cfg.train
        conditioning = conditioning or Conditioning(num_classes, channels=cfg.data.channels, resolution=cfg.data.resolution)
        if dctx is not None and builds_sharded(tc, cfg.model, dctx):
            try:
                return cls._build_sharded(cfg, num_classes, conditioning, network, init_weights, dctx)
            except meta_init.NotReplayable as e:  # raised before sharding: the network is built whole instead
                if dctx.is_main:
                    print(f"difftrain: warning: building the network whole on every rank, then sharding it: {e}",
                          file=sys.stderr)
        torch.manual_seed(derive_seed(tc.seed, "init"))
        model = build_network(cfg, conditioning, network, init_weights,  # float32: the base's digest taken
                              device=device, world_size=dctx.world_size if dctx is not None else 1)
        held = frozen_dtype(cfg, network)  # a LoRA run's frozen base in bf16/fp16 (networks/frozen_dtype.py)
        if held is not None and hold_frozen(model, held):
            model.held_dtype = held  # LoraNetwork: its forward outside the step's autocast runs under one
        model = prepare_model(model.to(device), device, tc.channels_last, tc.tf32, tc.cudnn_attention)
        ema = EMA(model, decay=cfg.ema.decay, warmup=cfg.ema.warmup, warmup_power=cfg.ema.warmup_power,
                  view=ema_is_view(cfg.ema.decay, cfg.ema.update_every_steps, cfg.optim.name))  # decay 0: no copy
        posthoc = PowerEMA(model, cfg.ema.posthoc_std)
        optimizer = build_optimizer(cfg.optim, model, device)
        state = cls(cfg, model, ema, optimizer, Precision(tc.precision, device), posthoc, num_classes, conditioning)
        state.net = model
        return state

    @classmethod
    def _build_sharded(cls, cfg: Config, num_classes: int, conditioning: Conditioning, network: dict | None,
                       init_weights: bool, dctx: DistContext) -> RunState:
        """The FSDP state of ``build`` with no whole copy: the network built on the meta device with
        its initialisation recorded (``runtime/meta_init.py``), its template, EMA and post-hoc EMAs
        copied there (no storage), the network sharded and given storage for its shards, then each
        parameter made whole once, alone, on the CPU and its shard kept: read from the safetensors files
        of ``model.init_from`` (a base family's denoiser, a LoRA's base, difftrain's UNet from a diffusers
        folder or weights file: ``runtime/tensor_source.py``; from a sharded checkpoint's folder no tensor is
        made whole: each rank reads its part of the EMA weights, ``sharded.load_part``), or else the recorded initialisation
        replayed with the run's seed (the values of an ordinary build, bit for bit: a LoRA adapter's
        start included; a ``model.init_from`` checkpoint's weights are what it copies in). The averages
        start as copies of the shards. A resume (``init_weights`` False) leaves the values the checkpoint
        holds to ``load_state_dict`` (a LoRA's base is still read from its files)."""
        tc, device = cfg.train, dctx.device
        torch.manual_seed(derive_seed(tc.seed, "init"))
        deferred = DeferredWeights()  # what model.init_from (a base, a LoRA's base) holds: read after sharding
        with meta_init.recorded_build() as recording:
            model = build_network(cfg, conditioning, network, init_weights, deferred=deferred)
        recording.bind(model)
        loaded = deferred.loaded(model)  # a sharded checkpoint's weights: each rank reads its own part, once sharded
        from_files = {name: read for name, read in deferred.bind(model).items() if name not in loaded}
        replayed = {name for name, _ in model.named_parameters()} - set(from_files) - loaded
        if init_weights:
            meta_init.check(recording, replayed)  # before anything is sharded, so that build() can still build it whole
        prepare_model(model, device, "off", tc.tf32, tc.cudnn_attention)  # backend flags; FSDP shards contiguous weights only
        template = fsdp.meta_template(model)
        ema = EMA(model, decay=cfg.ema.decay, warmup=cfg.ema.warmup, warmup_power=cfg.ema.warmup_power,
                  view=ema_is_view(cfg.ema.decay, cfg.ema.update_every_steps, cfg.optim.name))  # decay 0: no copy
        posthoc = PowerEMA(model, cfg.ema.posthoc_std)
        fsdp.shard_model(model, dctx, tc.precision, tc.fsdp_offload)
        gathered_in_compute_dtype(model, tc.precision)
        fsdp.materialize(model, fsdp.shard_device(tc.fsdp_offload, device))
        _fill_from_files(model, from_files, dctx)
        deferred.load_sharded(dctx)
        if init_weights:
            meta_init.replay(recording, lambda name, whole: fsdp.fill_shard(model, name, whole), replayed)
        for average in (*ema.copies(), *posthoc.models):  # each rank averages its own shard
            fsdp.copy_shards(average, model)
        ema.rebind()
        optimizer = build_optimizer(cfg.optim, model, fsdp.shard_device(tc.fsdp_offload, device))  # train.fsdp_offload: on the CPU
        state = cls(cfg, model, ema, optimizer, Precision(tc.precision, device), posthoc, num_classes, conditioning,
                    template=template, dctx=dctx)
        state.net = model
        return state

    def parallelize(self, dctx: DistContext) -> nn.Module:
        """The network that runs forward and backward under torchrun, set up once before the loop:
        ``model`` in DDP (``train.parallel = "ddp"``), or, with ``"fsdp"``, ``model`` sharded in place
        and the averages (EMA, post-hoc EMAs) laid out as its shards (``runtime/fsdp.py``; weights in
        the contiguous layout, train.channels_last does not apply), and the optimizer built anew over
        the shards (a LoRA run's: the adapter's), with the state it had (a
        resumed run's) carried over. In one process: ``model`` itself.

        With ``model.swap_blocks`` (a LoRA run, never under FSDP: the config refuses it) the block swap's plan is
        installed last (:attr:`swap`, ``networks/block_swap.swap_base``), over the network on its device, its frozen
        base in its held dtype and its checkpoint loaded, the averages sharing its base following it: run it eager
        (the loop passes compile "off"); :meth:`close` removes it."""
        if self.template is not None:  # built sharded (build with dctx)
            return self.model
        if self.cfg.train.parallel != "fsdp" or not dctx.enabled:
            net = distributed.wrap(self.model, dctx)  # DDP broadcasts the weights from the device: before the swap
            self.swap = swap_base(self.model, self.cfg.model.swap_blocks, dctx.device, [*self.ema.copies(), *self.posthoc.models])
            return net
        # FQN-keyed (not by parameter index), so it survives the parameters being replaced.
        carried = get_optimizer_state_dict(self.model, self.optimizer) if self.optimizer.state else None
        self.template = fsdp.meta_template(self.model)
        self.model.to(memory_format=torch.contiguous_format)  # FSDP shards contiguous weights only: no channels_last
        fsdp.shard_model(self.model, dctx, self.cfg.train.precision, self.cfg.train.fsdp_offload)
        gathered_in_compute_dtype(self.model, self.cfg.train.precision)
        for average in (*self.ema.copies(), *self.posthoc.models):  # each rank averages its own shard
            fsdp.shard_like(average.to(memory_format=torch.contiguous_format), self.model)
        self.ema.rebind()
        offload = fsdp.shard_device(self.cfg.train.fsdp_offload, dctx.device)  # train.fsdp_offload: on the CPU
        self.optimizer = build_optimizer(self.cfg.optim, self.model, offload)
        if carried is not None:
            set_optimizer_state_dict(self.model, self.optimizer, carried, options=StateDictOptions(full_state_dict=True))
        return self.model

    def close(self) -> None:
        """Undo what :meth:`parallelize` left in place that moves the network's weights: the block swap's plan
        (every frozen tensor back on the device, the same objects and values). A no-op without one."""
        if self.swap is not None:
            self.swap.remove()
            self.swap = None

    def evaluation_models(self) -> tuple[nn.Module, nn.Module]:
        """(model, EMA model) for evaluation: the run's own; under FSDP, the sharded model and the EMA
        run through it (``fsdp.AverageView``: its shards swapped in for each forward), both to be run in
        lockstep by every rank (validation, held-out loss and FID pad the last rank's share), no whole
        copy of either anywhere."""
        if self.template is None:
            return self.model, self.ema.model
        return self.model, fsdp.AverageView(self.model, self.ema.model)

    def gathered_models(self) -> tuple[nn.Module, nn.Module]:
        """(model, EMA model) as plain copies whose weights are gathered whole onto every rank under
        FSDP (a collective: every rank calls this; the run's own otherwise): for what needs the whole
        weights in each process (tests comparing them)."""
        if self.template is None:
            return self.model, self.ema.model
        device = self.precision.device  # the run's device
        model = fsdp.unsharded_copy(self.model, self.template, device)
        return model, fsdp.unsharded_copy(self.ema.model, self.template, device)

    def reading_weights(self):
        """A context in which ``model`` holds the weights to read (``training/optimizers.py``): a
        schedule-free optimizer's average; every other optimizer's weights as they are."""
        return reading_weights(self.optimizer)

    def state_dict(self) -> dict:
        """The checkpoint of this state (``checkpoint.SCHEMA``), with the global RNG states; its
        tensors are the live ones, so write it inside ``reading_weights()``."""
        return {
            "step": self.step,
            "data_position": self.position,  # global: resumes on any world size dividing it
            "skipped_steps": self.skipped_steps,
            "num_classes": self.num_classes,
            "config": config_to_dict(self.cfg),
            "model": self.model.state_dict(),
            "ema": self.ema.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.precision.state_dict(),
            "rng": rng_state(),
            "posthoc_ema": self.posthoc.state_dict(),
            "network": network_record(self.model),
            "frozen": self.conditioning.references(),  # named with digests, never saved
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint read by ``load_checkpoint`` (checked against the schema), or by
        :func:`load_resume` for a sharded state: its run state, the shards then read into this
        state's own (every rank calls it)."""
        if "shards" in state and self.template is None:  # built whole after all (meta_init.NotReplayable)
            state = load_checkpoint(state["path"])
        if "shards" in state:
            self._load_shards(state)
        else:
            self._load_tensors(state)
        self.precision.load_state_dict(state["scaler"])
        set_rng_state(state["rng"])
        self.step = state["step"]
        self.position = state["data_position"]
        self.skipped_steps = state["skipped_steps"]

    def _load_shards(self, state: dict) -> None:
        """Every rank reads its part of the sharded checkpoint ``state["shards"]`` into the model, the
        averages and the optimizer (``sharded.load_shards``); a post-hoc EMA the
        checkpoint lacks is refused as :meth:`PowerEMA.load_state_dict` refuses it."""
        path = state["path"]
        saved_stds = [float(s) for s in state["posthoc_ema"]["stds"]]
        self.posthoc.check_resumable(saved_stds, path)
        tensors = sharded.shard_tensors(self.model, self.ema.model, [], self.optimizer)
        if self.ema.is_view:  # its tensors are the model's: read once, from "model"
            del tensors["ema"]
        tensors["posthoc_ema"] = {str(saved_stds.index(s)): m.state_dict() for s, m in zip(self.posthoc.stds, self.posthoc.models)}
        sharded.load_shards(Path(path), tensors, self.dctx)
        self.ema.num_updates = int(state["ema"]["num_updates"])
        try:
            set_optimizer_state_dict(self.model, self.optimizer, {"state": tensors["optimizer"],
                                                                  "param_groups": state["optimizer_param_groups"]})
            to_training(self.optimizer)
        except (ValueError, KeyError, RuntimeError) as e:
            raise ValueError(f"checkpoint {path}: key 'optimizer' does not fit this model: {e}") from None

    def _load_tensors(self, state: dict) -> None:
        """The weights, averages and optimizer state of a checkpoint read whole (into a sharded
        state: :meth:`_load_whole_into_shards`)."""
        path = state.get("path", "checkpoint")
        if self.template is not None:
            self._load_whole_into_shards(state)
            return
        load_weights(self.model, state["model"], path, "model")
        if not self.ema.is_view:  # a view's weights are the model's
            load_weights(self.ema.model, state["ema"]["model"], path, "ema.model")
        self.ema.load_state_dict(state["ema"])
        self.posthoc.load_state_dict(state["posthoc_ema"], path)
        try:
            if state.get("layout") == "sharded":  # FQN-keyed (checkpoints/sharded.py)
                set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
            else:
                self.optimizer.load_state_dict(state["optimizer"])
            to_training(self.optimizer)  # schedule-free: saved as x in eval mode, trains as y
        except (ValueError, KeyError, RuntimeError) as e:
            raise ValueError(f"checkpoint {path}: key 'optimizer' does not fit this model: {e}") from None

    def _load_whole_into_shards(self, state: dict) -> None:
        """A checkpoint file (a run in one process, or under DDP) into a state built sharded: each
        rank keeps its part of each whole tensor; the optimizer's state, keyed by index in a file,
        keyed by parameter name and sharded by ``set_optimizer_state_dict``."""
        path = state.get("path", "checkpoint")
        load_weights(self.model, state["model"], path, "model", fill=fsdp.fill_shards)
        if not self.ema.is_view:  # a view's weights are the model's
            load_weights(self.ema.model, state["ema"]["model"], path, "ema.model", fill=fsdp.fill_shards)
        self.ema.num_updates = int(state["ema"]["num_updates"])
        saved = dict(zip((float(s) for s in state["posthoc_ema"]["stds"]), state["posthoc_ema"]["models"]))
        self.posthoc.check_resumable(list(saved), path)
        for s, average in zip(self.posthoc.stds, self.posthoc.models):
            load_weights(average, saved[s], path, f"posthoc_ema[{s}]", fill=fsdp.fill_shards)
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]  # build_optimizer's order
        try:
            saved_optimizer = state["optimizer"]
            by_name = {"state": {names[i]: v for i, v in saved_optimizer["state"].items()},
                       "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                        for g in saved_optimizer["param_groups"]]}
            set_optimizer_state_dict(self.model, self.optimizer, by_name, options=StateDictOptions(full_state_dict=True))
            to_training(self.optimizer)
        except (ValueError, KeyError, RuntimeError, IndexError, TypeError) as e:
            raise ValueError(f"checkpoint {path}: key 'optimizer' does not fit this model: {e}") from None

    def check_resumable(self, state: dict, world_size: int) -> list[str]:
        """Raise ValueError if ``state`` cannot continue this run (a changed model or data, a
        data position the world size does not divide); else the lines naming allowed changes."""
        path = state.get("path", "checkpoint")
        unknown = unknown_keys(state["config"])
        if unknown:  # another difftrain version's config, or an edited one: its meaning is unknown here
            raise ValueError(f"cannot resume from {path}: its stored config has the unknown config "
                             f"{' and '.join(unknown)}; sections: {', '.join(config_to_dict(self.cfg))}")
        new = config_to_dict(self.cfg)
        bad = incompatible_keys(state["config"], new)
        if bad:
            lines = "\n".join(f"  {k}: checkpoint {old!r}, now {now!r}" for k, (old, now) in bad.items())
            raise ValueError(f"cannot resume from {path}: the config changes the model or data:\n{lines}")
        if state["num_classes"] != self.num_classes:
            raise ValueError(f"cannot resume from {path}: it has {state['num_classes']} classes, the data "
                             f"{self.num_classes}")
        self.conditioning.check_references(state["frozen"], f"checkpoint {path}")
        mismatch = lora_mismatch(self.cfg.lora, state["network"]) or optimizer_mismatch(state["config"], self.cfg.optim)
        if mismatch:
            raise ValueError(f"cannot resume from {path}: {mismatch}")
        if state["data_position"] % world_size:
            raise ValueError(
                f"cannot resume {path} on {world_size} processes: its data position "
                f"{state['data_position']} (images seen) is not a multiple of the world size"
            )
        return [f"resuming with a changed {k}: checkpoint {old!r}, now {now!r}"
                for k, (old, now) in allowed_changes(state["config"], new).items()]


def builds_sharded(tc: TrainConfig, m: ModelConfig, dctx: DistContext) -> bool:
    """Whether ``RunState.build`` builds the state of a run (its train section ``tc``, model section ``m``)
    sharded, with no whole copy: FSDP on several ranks; difftrain's UNet, a base family's denoiser or a LoRA
    network (its adapter started from ``model.init_lora_from`` or not), from scratch, from ``model.init_from``
    (safetensors, a ``.bin`` folder, a checkpoint file) or resumed. Still built whole on each rank, then
    sharded (``RunState.parallelize``): a LoRA over a quantized base (``model.quantize_base``: its base is
    quantized as it loads, ``networks/build.py``), and every network where accelerate (whose
    ``init_empty_weights`` builds on the meta device) is not installed."""
    if tc.parallel != "fsdp" or not dctx.enabled or not meta_init.available():
        return False
    return m.quantize_base == "off"


def load_resume(source: Path | None, cfg: Config, dctx: DistContext) -> dict | None:
    """The checkpoint ``source`` to resume from, as ``RunState.load_state_dict`` takes it: read whole
    (``load_checkpoint``), or, when it is a sharded checkpoint and the state is built sharded
    (:func:`builds_sharded`), its run state alone (``"shards"``: the folder each rank reads its part
    of). None without a source."""
    if source is None:
        return None
    state = load_checkpoint(source, tensors=False)
    if "shards" in state and not builds_sharded(cfg.train, cfg.model, dctx):
        state = load_checkpoint(source)
    return state


def resume_source(run_dir: Path, resume: str | Path | None) -> Path | None:
    """The checkpoint to continue from: ``resume`` if given, else the run's newest, else None."""
    if resume is not None:
        return Path(resume)
    try:
        return find_checkpoint(run_dir / "checkpoints")
    except FileNotFoundError:
        return None


def _fill_from_files(model: nn.Module, readers: dict, dctx: DistContext) -> None:
    """Each rank's rows of the base's weights (``readers``: name -> reader, one tensor at a time), the ranks agreeing
    on a weight that is not finite: it lies in one rank's rows only, and that rank's ValueError names the file; the
    others end with it too, naming the rank, instead of waiting at their next collective."""
    bad = ""
    try:
        for name, read in readers.items():
            fsdp.fill_shard_from(model, name, read)
    except ValueError as e:
        bad = str(e)
    first = distributed.max_over_ranks(dctx.world_size - dctx.rank if bad else 0, dctx)
    if bad:
        raise ValueError(bad)
    if first:
        raise ValueError(f"model.init_from: a weight of the base is not finite (NaN or infinity) in the rows rank "
                         f"{dctx.world_size - first} read (its message names the file)")


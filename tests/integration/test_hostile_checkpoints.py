"""Hostile sharded (DCP) checkpoints and weights files: no file difftrain opens runs code, and a
crafted, truncated, lying or incomplete one is refused with one line naming it, exit 2.

The sharded checkpoint is a real one, written in this process by the FSDP save path
(``sharded.save_or_report`` without a process group: one shard file); 2-rank ones are
read by tests/integration/test_fsdp.py through the same reader. The commands run in-process.
"""

from __future__ import annotations

import io
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from difftrain.cli import EXIT_BAD_INPUT, main
from difftrain.config import config_from_dict, load_config
from difftrain.checkpoints import checkpoint as ckpt
from difftrain.training.loop import train
from tests.conftest import TINY_OVERRIDES

RUN = TINY_OVERRIDES + ["train.total_steps=2", "validation.every_steps=0", "tracking.tensorboard=false"]
DCP = "step_00000002.dcp"


class _Payload:
    """Unpickled by plain pickle, it creates the file ``marker``: the proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _as_sharded(run: Path) -> Path:
    """Replace the run's step-2 checkpoint file by the sharded folder an FSDP run writes."""
    from difftrain.networks.conditioning import Conditioning
    from difftrain.runtime import distributed
    from difftrain.checkpoints import sharded as sharded
    from difftrain.training.state import RunState

    saved = ckpt.load_checkpoint(run)
    cfg, cpu = config_from_dict(saved["config"]), torch.device("cpu")
    state = RunState.build(cfg, saved["num_classes"], cpu, init_weights=False, network=saved["network"],
                           conditioning=Conditioning.from_config(cfg, saved["num_classes"], cpu))
    state.load_state_dict(saved)
    with pytest.warns(UserWarning, match="single process"):  # DCP without a process group
        folder = sharded.save_or_report(state, state.state_dict(), run / "checkpoints", saved["step"], 3, 0,
                                        "stop", distributed.setup(cpu, 60))
    Path(saved["path"]).unlink()
    return folder


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> Path:
    """A tiny run at step 2 whose only checkpoint is a sharded folder (about 3 s)."""
    run = tmp_path_factory.mktemp("sharded") / "run"
    train(load_config(None, RUN), run)
    folder = _as_sharded(run)
    assert folder.name == DCP and ckpt.find_checkpoint(run) == folder
    return run


def _copy(run: Path, to: Path) -> tuple[Path, Path]:
    shutil.copytree(run, to)
    return to, to / "checkpoints" / DCP


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


def test_a_real_sharded_checkpoint_loads_and_resumes(sharded_run, tmp_path, capsys):
    run, _ = _copy(sharded_run, tmp_path / "run")
    assert main(["inspect", str(run)]) == 0
    assert DCP in capsys.readouterr().out
    assert train(load_config(None, RUN + ["train.total_steps=4"]), run).step == 4


@pytest.fixture(scope="module")
def crafted_run(sharded_run, tmp_path_factory) -> tuple[Path, Path]:
    """A copy of ``sharded_run`` whose ``.metadata`` is a pickle that creates ``marker``: plain
    ``pickle.load`` (what torch's DCP reader does) runs it."""
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("crafted")
    run, folder = _copy(sharded_run, root / "run")
    marker = root / "marker"
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    dcp.FileSystemReader(folder).read_metadata()  # torch's own reader: the payload runs
    assert marker.exists()
    marker.unlink()
    return run, marker


def _train_args(run_dir: Path, *overrides: str) -> list[str]:
    return ["train", "--run-dir", str(run_dir)] + [x for o in [*RUN, *overrides] for x in ("--set", o)]


COMMANDS = {  # command -> its arguments, given (crafted run, scratch folder)
    "sample": lambda run, out: ["sample", "--checkpoint", str(run), "--num", "1", "--steps", "2", "--out", str(out)],
    "export": lambda run, out: ["export", str(run), str(out / "m.safetensors"), "--format", "safetensors"],
    "eval": lambda run, out: ["eval", "--checkpoint", str(run), "--num", "2", "--steps", "2"],
    "train-resume": lambda run, out: _train_args(run, "train.total_steps=4"),
    "inspect": lambda run, out: ["inspect", str(run)],
    "posthoc-ema": lambda run, out: ["posthoc-ema", str(run), "--std", "0.07", "--out", str(out / "p.pt")],
    "diagnose": lambda run, out: ["diagnose", "--checkpoint", str(run), "--num-images", "2"],
    "init_from": lambda run, out: _train_args(out / "new", f"model.init_from={run / 'checkpoints' / DCP}"),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_a_crafted_dcp_metadata_runs_no_code(crafted_run, command, tmp_path, capsys):
    run, marker = crafted_run
    code = main(COMMANDS[command](run, tmp_path))
    line = _one_error_line(capsys.readouterr().err)
    assert code == EXIT_BAD_INPUT
    assert str(run / "checkpoints" / DCP / ".metadata") in line and "never holds" in line, line
    assert not marker.exists()


def _pickled_payload(folder: Path, marker: Path) -> tuple[int, int]:
    """Append to the folder's shard file what DCP's default planner reads for a bytes entry with
    ``torch.load(weights_only=False)``: a pickle that creates ``marker``; (offset, length) of it."""
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    shard = folder / "__0_0.distcp"
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buf.getvalue())
    return offset, len(buf.getvalue())


def _declare_bytes(m, folder: Path, fqn: str, marker: Path) -> None:
    """Declare ``fqn`` in the metadata ``m`` as DCP bytes stored in a pickle that creates ``marker``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    offset, length = _pickled_payload(folder, marker)
    m.state_dict_metadata[fqn] = BytesStorageMetadata()
    m.storage_data[MetadataIndex(fqn)] = _StorageInfo(relative_path="__0_0.distcp", offset=offset, length=length)


def _bytes_entry(m, folder: Path, marker: Path) -> None:
    """(a) One entry added, declared as bytes."""
    _declare_bytes(m, folder, "model.payload", marker)


def _alias_of_bytes(m, folder: Path, marker: Path) -> None:
    """(b) A bytes entry and a tensor entry (a copy of the smallest model weight's, on its bytes) whose key
    path (``planner_data``) joins to the bytes entry's key: the state dict made from the key paths asks
    DCP's planner for the bytes."""
    import copy

    from torch.distributed.checkpoint.metadata import MetadataIndex

    _declare_bytes(m, folder, "model.payload", marker)
    name, item = min(((k, v) for k, v in m.state_dict_metadata.items() if k.startswith("model.") and hasattr(v, "chunks")),
                     key=lambda kv: kv[1].size.numel())
    m.state_dict_metadata["model.alias"] = copy.deepcopy(item)
    for chunk in item.chunks:
        m.storage_data[MetadataIndex("model.alias", chunk.offsets)] = m.storage_data[MetadataIndex(name, chunk.offsets)]
    m.planner_data = {**(m.planner_data or {}), "model.alias": ("model", "payload")}


def _weight_as_bytes(m, folder: Path, marker: Path) -> None:
    """(c) A real weight of the model re-declared as bytes (what an FSDP resume asks DCP for by its name)."""
    name = next(k for k, v in m.state_dict_metadata.items() if k.startswith("model.") and hasattr(v, "chunks"))
    _declare_bytes(m, folder, name, marker)


# case -> (craft(metadata, folder, marker), what the refusal says)
BYTES_CASES = {"bytes-entry": (_bytes_entry, "as pickled bytes"),
               "alias-of-bytes": (_alias_of_bytes, "joins to another key"),
               "weight-as-bytes": (_weight_as_bytes, "as pickled bytes")}


@pytest.fixture(scope="module")
def bytes_runs(sharded_run, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Per case of :data:`BYTES_CASES`: a copy of ``sharded_run`` whose ``.metadata`` (safe to read: only
    DCP's own classes) declares entries as DCP bytes holding a pickle that creates ``marker``; (run, marker)."""
    runs = {}
    for case, (craft, _) in BYTES_CASES.items():
        root = tmp_path_factory.mktemp(case)
        run, folder = _copy(sharded_run, root / "run")
        _rewrite_metadata(folder, lambda m, craft=craft, folder=folder, root=root: craft(m, folder, root / "marker"))
        runs[case] = run, root / "marker"
    return runs


@pytest.mark.parametrize("case", BYTES_CASES)
@pytest.mark.parametrize("command", COMMANDS)
def test_a_dcp_bytes_entry_runs_no_code(bytes_runs, case, command, tmp_path, capsys):
    """DCP's default load planner unpickles every bytes entry it is asked for (``torch.load(weights_only=False)``):
    a bytes entry, a key path that aliases one, a weight declared as one are refused from the metadata, one line
    naming it, exit 2, and the payload never runs."""
    run, marker = bytes_runs[case]
    code = main(COMMANDS[command](run, tmp_path))
    line = _one_error_line(capsys.readouterr().err)
    assert not marker.exists()
    assert code == EXIT_BAD_INPUT
    assert str(run / "checkpoints" / DCP / ".metadata") in line and BYTES_CASES[case][1] in line, line


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP without a process group
def test_every_dcp_read_has_a_planner_that_never_unpickles(bytes_runs, sharded_run, tmp_path):
    """Defence in depth: a bytes entry that reached DCP's loader (through torch's own reader, unchecked) is
    refused by the planner every read uses (``dcp_reader.load``), and an FSDP resume's fill of its own state
    dict (the weight's real name declared as bytes) is refused before DCP reads anything."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from difftrain.runtime import distributed
    from difftrain.checkpoints import dcp_reader
    from difftrain.checkpoints import sharded as sharded

    run, marker = bytes_runs["bytes-entry"]
    folder = run / "checkpoints" / DCP
    with pytest.raises(CheckpointException, match="as pickled bytes"):
        dcp_reader.load({"model": {"payload": io.BytesIO()}}, dcp.FileSystemReader(folder), no_dist=True)
    assert not marker.exists()
    # Every read of DCP in src goes through it.
    src = Path(__file__).resolve().parents[2] / "src" / "difftrain"
    callers = [p.relative_to(src) for p in src.rglob("*.py") if "dcp.load(" in p.read_text()]
    assert callers == [Path("checkpoints/dcp_reader.py")], callers
    # An FSDP resume asks for the checkpoint's tensors by their own names: a weight declared as bytes.
    run, marker = bytes_runs["weight-as-bytes"]
    saved = ckpt.load_checkpoint(sharded_run)
    tensors = {"model": dict(saved["model"]), "ema": dict(saved["ema"]["model"]), "optimizer": {},
               "posthoc_ema": {str(k): dict(m) for k, m in enumerate(saved["posthoc_ema"]["models"])}}
    with pytest.raises(ckpt.CheckpointError, match="as pickled bytes"):
        sharded.load_shards(run / "checkpoints" / DCP, tensors, distributed.setup(torch.device("cpu"), 60))
    assert not marker.exists()


def test_a_sharded_checkpoint_to_start_an_fsdp_run_from_is_checked_from_its_metadata_alone(sharded_run, crafted_run):
    """FSDP's sharded start from a sharded checkpoint's folder (``model.init_from``; the network on the meta
    device, ``interop.defer_init_weights``): checked against the model from its metadata alone, through the
    same allow-list reader (a crafted ``.metadata`` refused, nothing run), a model of another width refused in
    one line naming the first mismatched key, and a matching one recorded to be loaded into its shards by each
    rank (tests/integration/test_fsdp_meta_bases.py loads it on 2 ranks), no tensor read yet; read one whole
    tensor at a time too, the checkpoint's EMA weights."""
    from difftrain.networks.conditioning import Conditioning
    from difftrain.networks.init_from import defer_init_weights
    from difftrain.runtime import meta_init
    from difftrain.runtime.tensor_source import DeferredWeights
    from difftrain.networks.build import build_network

    saved = ckpt.load_checkpoint(sharded_run, tensors=False)

    def meta_model(*overrides):
        cfg = load_config(None, [*RUN, *overrides])
        with meta_init.empty_build():
            return build_network(cfg, Conditioning.from_config(cfg, saved["num_classes"], torch.device("cpu")))

    model, deferred = meta_model(), DeferredWeights()
    assert defer_init_weights(model, sharded_run, deferred)  # the run directory: its newest, the sharded folder
    assert all(p.is_meta for p in model.parameters())  # nothing read yet
    assert deferred.loaded(model) == set(model.state_dict())  # a sharded network: each rank its part, in place
    # What needs whole tensors (a LoRA base, a quantized one) reads them one at a time, through the same reader.
    readers, ema = deferred.bind(model), ckpt.load_checkpoint(sharded_run)["ema"]["model"]
    assert readers.keys() == ema.keys() and all(torch.equal(readers[k](), ema[k]) for k in list(ema)[:5])
    with pytest.raises(ValueError, match=r"^model\.init_from .*: the weights do not match this model's architecture: "
                                         r"first mismatched key '\S+' \(shape"):
        defer_init_weights(meta_model("model.base_channels=16"), sharded_run, DeferredWeights())
    run, marker = crafted_run
    with pytest.raises(ckpt.CheckpointError, match="never holds"):
        defer_init_weights(meta_model(), run / "checkpoints" / DCP, DeferredWeights())
    assert not marker.exists()


def _rewrite_metadata(folder: Path, change) -> None:
    """Unpickle the (test's own, trusted) metadata, ``change(metadata)``, write it back."""
    path = folder / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    change(metadata)
    path.write_bytes(pickle.dumps(metadata))


def _first_tensor(m):
    return next(v for v in m.state_dict_metadata.values() if hasattr(v, "chunks"))


def _all_on_the_same_bytes(m) -> None:
    """Every tensor one chunk stored in the same (largest) byte range of the shard file: each entry
    fits the file, together they claim far more than it holds."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    big = max(m.storage_data.values(), key=lambda info: info.length)
    numel = big.length // 4 - 100
    storage = {}
    for fqn, item in m.state_dict_metadata.items():
        item.size, item.properties.dtype = torch.Size([numel]), torch.float32
        item.chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([numel]))]
        storage[MetadataIndex(fqn, [0])] = big
    m.storage_data = storage


def _cut(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _break_zip_header(path: Path) -> None:
    with open(path, "r+b") as f:
        f.write(b"\0" * 64)


def _run_state_with(folder: Path, change) -> None:
    state = torch.load(folder / "run_state.pt", weights_only=True)
    change(state)
    torch.save(state, folder / "run_state.pt")


def _clashing_key_paths(m) -> None:
    """Two tensors renamed so that one's key path is a prefix of the other's (their tensors would overwrite
    a dict), each path its own key's."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    renames = dict(zip(list(m.state_dict_metadata)[:2], ("model.w", "model.w.x")))
    m.state_dict_metadata = {renames.get(k, k): v for k, v in m.state_dict_metadata.items()}
    m.storage_data = {MetadataIndex(renames.get(i.fqn, i.fqn), i.offset, i.index): info
                      for i, info in m.storage_data.items()}
    m.planner_data = {renames.get(k, k): v for k, v in (m.planner_data or {}).items()}
    m.planner_data.update({"model.w": ("model", "w"), "model.w.x": ("model", "w", "x")})


def _aliasing_key_path(m) -> None:
    """A tensor's key path that joins to another tensor's key."""
    first, second = list(m.state_dict_metadata)[:2]
    m.planner_data = {**(m.planner_data or {}), first: tuple(second.split("."))}


def _crafted_run_state(folder: Path) -> None:
    state = torch.load(folder / "run_state.pt", weights_only=True)
    torch.save({**state, "extra": _Payload(folder / "marker")}, folder / "run_state.pt")


# case -> (damage(folder), the file the line names, what it says)
DAMAGE = {
    "metadata-crafted": (lambda f: (f / ".metadata").write_bytes(pickle.dumps(_Payload(f / "marker"))),
                         ".metadata", "a crafted file"),
    "metadata-truncated": (lambda f: _cut(f / ".metadata"), ".metadata", "refused"),
    "metadata-missing": (lambda f: (f / ".metadata").unlink(), ".metadata", "is missing"),
    "metadata-foreign": (lambda f: (f / ".metadata").write_bytes(pickle.dumps({"a": 1})), ".metadata",
                         "holds a dict"),
    "metadata-size-lies": (lambda f: _rewrite_metadata(f, lambda m: setattr(_first_tensor(m), "size",
                                                                            torch.Size([10**6, 10**6]))),
                           ".metadata", "chunks of"),
    "metadata-length-lies": (lambda f: _rewrite_metadata(f, lambda m: setattr(next(iter(m.storage_data.values())),
                                                                              "length", 10**12)),
                             ".metadata", "sizes that lie"),
    "metadata-path-escapes": (lambda f: _rewrite_metadata(f, lambda m: setattr(
                                  next(iter(m.storage_data.values())), "relative_path", "../../x.distcp")),
                              ".metadata", "not a .distcp file of this folder"),
    "metadata-chunks-share-bytes": (lambda f: _rewrite_metadata(f, _all_on_the_same_bytes), ".metadata",
                                    "its shard files hold"),
    "shard-truncated": (lambda f: _cut(f / "__0_0.distcp"), ".metadata", "of __0_0.distcp, which holds"),
    "shard-missing": (lambda f: (f / "__0_0.distcp").unlink(), ".metadata", "__0_0.distcp it names is missing"),
    "shard-damaged": (lambda f: _break_zip_header(f / "__0_0.distcp"), DCP, "cannot read the shards"),
    "run-state-crafted": (_crafted_run_state, "run_state.pt", "other than tensors"),
    "run-state-truncated": (lambda f: _cut(f / "run_state.pt"), "run_state.pt", "cannot load checkpoint"),
    "run-state-missing": (lambda f: (f / "run_state.pt").unlink(), DCP, "no run_state.pt"),
    "run-state-updates-lie": (lambda f: _run_state_with(f, lambda s: s["ema"].update(num_updates="many")),
                              "run_state.pt", "ema.num_updates must be a count"),
    "run-state-stds-missing": (lambda f: _run_state_with(f, lambda s: s["posthoc_ema"].pop("stds", None)),
                               "run_state.pt", "posthoc_ema.stds must be a list"),
    "metadata-key-paths-clash": (lambda f: _rewrite_metadata(f, _clashing_key_paths), DCP,
                                 "clashing with another tensor's"),
    "metadata-key-path-aliases": (lambda f: _rewrite_metadata(f, _aliasing_key_path), ".metadata",
                                  "which joins to another key"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_sharded_checkpoint_is_one_line_naming_the_file(sharded_run, case, tmp_path, capsys):
    damage, named, says = DAMAGE[case]
    _, folder = _copy(sharded_run, tmp_path / "run")
    damage(folder)
    code = main(["inspect", str(folder)])
    line = _one_error_line(capsys.readouterr().err)
    assert code == EXIT_BAD_INPUT
    assert str(folder if named == DCP else folder / named) in line and says in line, line
    assert not (folder / "marker").exists()


# Weights files and checkpoint files: NaN weights refused where read, naming the tensor; a weights
# file crafted, truncated, lying or missing refused like a checkpoint.


@pytest.fixture(scope="module")
def file_run(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny run at step 2 (a checkpoint file) and its EMA weights exported as a weights file."""
    root = tmp_path_factory.mktemp("file_run")
    train(load_config(None, RUN), root / "run")
    assert main(["export", str(root / "run"), str(root / "m.safetensors"), "--format", "safetensors"]) == 0
    return root / "run", root / "m.safetensors"


def _rewrite_weights(path: Path, tensors=None, metadata=None) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    weights = load_file(str(path))
    if tensors:
        tensors(weights)
    save_file(weights, str(path), metadata={**meta, **(metadata or {})})


def _nan_in_fourth(weights: dict) -> None:
    weights[sorted(weights)[3]][0] = float("nan")


def _sample(source: Path, out: Path) -> int:
    return main(["sample", "--checkpoint", str(source), "--num", "1", "--steps", "2", "--out", str(out)])


def test_non_finite_checkpoint_weights_are_refused_where_read(file_run, tmp_path, capsys):
    run, _ = _copy(file_run[0], tmp_path / "run")
    path = run / "checkpoints" / "step_00000002.pt"
    state = torch.load(path, weights_only=True)
    name = sorted(state["ema"]["model"])[3]
    state["ema"]["model"][name][0] = float("inf")
    torch.save(state, path)
    code = _sample(run, tmp_path / "s")
    line = _one_error_line(capsys.readouterr().err)
    assert code == EXIT_BAD_INPUT and str(path) in line and name in line and "not finite" in line, line
    assert not list((tmp_path / "s").glob("*.png"))


WEIGHTS_DAMAGE = {  # case -> (damage(path), what the line says)
    "nan-weights": (lambda p: _rewrite_weights(p, tensors=_nan_in_fourth), "is not finite"),
    "step-negative": (lambda p: _rewrite_weights(p, metadata={"step": "-5"}), "'step' must be an integer >= 0, got -5"),
    "crafted-pickle": (lambda p: torch.save({"x": _Payload(p.parent / "marker")}, p), "cannot read weights file"),
    "truncated": (lambda p: _cut(p, 0.001), "cannot read weights file"),
    "header-claims-more-bytes": (lambda p: p.write_bytes(p.read_bytes()[:-64]), "cannot read weights file"),
    "header-length-lies": (lambda p: p.write_bytes((2**40).to_bytes(8, "little") + p.read_bytes()[8:]),
                           "cannot read weights file"),
    "missing": (lambda p: p.unlink(), "no checkpoint at"),
}


@pytest.mark.parametrize("case", WEIGHTS_DAMAGE)
def test_a_hostile_weights_file_is_one_line_naming_it(file_run, case, tmp_path, capsys):
    damage, says = WEIGHTS_DAMAGE[case]
    path = tmp_path / "m.safetensors"
    shutil.copy(file_run[1], path)
    damage(path)
    code = _sample(path, tmp_path / "s")
    line = _one_error_line(capsys.readouterr().err)
    assert code == EXIT_BAD_INPUT and str(path) in line and says in line, line
    assert not list((tmp_path / "s").glob("*.png")) and not (tmp_path / "marker").exists()
    if case == "nan-weights":
        assert sorted(torch.load(file_run[0] / "checkpoints" / "step_00000002.pt")["ema"]["model"])[3] in line

"""The frozen text encoder of a text-to-image model: a CLIP text transformer and its tokenizer.

``TextEncoder.from_path`` loads one from a local folder (a transformers CLIP text model with
its tokenizer files), from a Stable Diffusion pipeline folder (``text_encoder/`` and
``tokenizer/``), or builds ``builtin:tiny-clip``: a small CLIP text model whose weights
difftrain draws itself from a fixed seed, with a word vocabulary that covers the built-in
datasets' captions. Nothing is downloaded. transformers is imported only when a model is
loaded, so importing this module is cheap. Also the one weight digest of frozen parts
(:func:`weights_digest`) and the one tokenization of captions (:func:`tokenize`) every
family's text encoders use.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from difftrain.runtime import stored_digest
from difftrain.runtime.optional import require
from difftrain.runtime.tensor_source import TensorSource, check_weight_indexes, index_files

BUILTIN_PREFIX = "builtin:"
BOS, EOS = "<|startoftext|>", "<|endoftext|>"  # CLIP's special tokens; EOS also pads
END_OF_WORD = "</w>"  # CLIP's BPE marks the last symbol of a word with this suffix

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                "pytorch_model.bin.index.json")
TEXT_MODEL_TYPES = ("clip_text_model", "clip")  # a CLIP text model, or a whole CLIP model (its text half)

# builtin:tiny-clip. The words of the built-in datasets' captions; any other word is spelled
# out from single characters (every byte has a token, as in CLIP), so nothing is unknown.
TINY_CLIP_WORDS = (
    "a an the on of in and with background dark light bright disc square triangle circle shape "
    "small large red orange yellow green cyan blue purple pink magenta white black gray grey"
).split()
TINY_CLIP_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       max_position_embeddings=16)
TINY_CLIP_SEED = 20240613


def bytes_to_unicode() -> dict[int, str]:
    """Byte-level BPE's map of the 256 byte values to printable characters (GPT-2, CLIP):
    printable Latin-1 bytes stand for themselves, the others for characters from U+0100 on."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def learn_word_merges(words: list[str]) -> list[tuple[str, str]]:
    """BPE merges that make each of ``words`` (lowercase ASCII) one token: learned as BPE
    learns them (most frequent adjacent pair first, ties by the pair's text), until every word
    is a single symbol, so that encoding a word with them gives back that one token."""
    seqs = [list(w[:-1]) + [w[-1] + END_OF_WORD] for w in dict.fromkeys(words) if len(w) > 1]
    merges: list[tuple[str, str]] = []
    while seqs:
        counts = Counter(pair for s in seqs for pair in zip(s, s[1:]))
        best = min(counts, key=lambda p: (-counts[p], p))
        merges.append(best)
        for s in seqs:
            i = 0
            while i < len(s) - 1:
                if (s[i], s[i + 1]) == best:
                    s[i : i + 2] = [s[i] + s[i + 1]]
                i += 1
        seqs = [s for s in seqs if len(s) > 1]
    return merges


def word_vocabulary(words: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of a CLIP BPE tokenizer that knows ``words`` as whole tokens: the 256
    byte characters, the same with the end-of-word mark, the merged symbols, then BOS and EOS."""
    chars = list(bytes_to_unicode().values())
    merges = learn_word_merges([w.lower() for w in words])
    tokens = chars + [c + END_OF_WORD for c in chars] + [a + b for a, b in merges] + [BOS, EOS]
    return {t: i for i, t in enumerate(dict.fromkeys(tokens))}, merges


def weights_digest(module: nn.Module, extra: bytes = b"", strip: str = "") -> str:
    """SHA-256 (hex) of a module's parameters and persistent float buffers, by sorted name
    (``strip`` removed from the front of names, so a wrapper prefix doesn't count), each
    with its shape and float32 bytes, then ``extra`` (the tokenizers' vocabularies: :func:`vocab_bytes`).
    The one digest of frozen parts (text encoders, VAEs, a LoRA's base): checkpoints record it and a
    resumed run compares it, so its bytes never change. Several models are digested as one
    ``nn.ModuleList`` of them (names ``0.``, ``1.``, ...)."""
    tensors = {n.removeprefix(strip): t for n, t in module.state_dict().items()}
    return tensors_digest(((name, tensors[name]) for name in sorted(tensors)), extra)


def tensors_digest(tensors: Iterable[tuple[str, torch.Tensor]], extra: bytes = b"") -> str:
    """:func:`weights_digest` of (name, tensor) pairs given one at a time in sorted name order (a
    network's weights read from its files one tensor at a time: ``runtime/tensor_source.py``); tensors
    that are not floating point are left out."""
    h = hashlib.sha256()
    for name, t in tensors:
        if not t.is_floating_point():
            continue
        t = t.detach().to("cpu", torch.float32).contiguous()
        h.update(f"{name}:{tuple(t.shape)}\n".encode())
        h.update(t.numpy().tobytes())
    h.update(extra)
    return h.hexdigest()


def model_weights_source(folder: Path) -> TensorSource | None:
    """The weights of a transformers model folder (``model.safetensors``, its ``.index.json``'s files,
    ``pytorch_model.bin`` or its index's: :data:`WEIGHT_FILES`) or a diffusers one, mapped without reading a
    value; None when it holds none (or a ``.bin`` that cannot be mapped)."""
    folder = Path(folder)
    for name in WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        files = index_files(path) if name.endswith(".index.json") else [path]
        if name.startswith("model.safetensors"):
            return TensorSource.of_files(files)
        try:
            return TensorSource.of_torch_files(files)
        except ValueError:
            return None
    return TensorSource.of_folder(folder)


def tokenizer_files(folder: Path) -> list[Path]:
    """The files of a tokenizer folder that are no weights nor model config (vocabularies, merges, special
    tokens, the tokenizer's config), sorted."""
    skip = set(WEIGHT_FILES) | {"config.json"}
    return sorted(f for f in Path(folder).rglob("*") if f.is_file() and f.name not in skip
                  and not f.name.endswith((".safetensors", ".bin")))


def files_digest(models: list[Path], tokenizers: list[Path], extra: bytes = b"") -> str:
    """The digest of frozen text encoders from their files as stored (``runtime.stored_digest``'s STORED kind):
    each model folder's tensors as their files hold them (never upcast: a bf16 file hashes 2 bytes a weight,
    and the dtype a run holds them in does not count; cached by the files' fingerprint), in order, then every
    tokenizer file's bytes (:func:`tokenizer_files`, by its folder and name), then ``extra`` (a family's
    settings that enter the condition). ValueError naming a model folder without weights."""
    h = hashlib.sha256(b"difftrain frozen encoders stored v1\n")
    for i, folder in enumerate(models):
        try:
            source = model_weights_source(folder)
            value = None if source is None else stored_digest.stored_digest(source)
        except (ValueError, OSError, KeyError) as e:  # a damaged file: one line naming the part
            raise ValueError(f"text encoder {folder}: cannot read its weights: {first_line(e)}") from None
        if value is None:
            raise ValueError(f"text encoder {folder}: no weights file to take its digest from "
                             f"(looked for {', '.join(WEIGHT_FILES)})")
        h.update(f"{i}:{value}\n".encode())
    for folder in tokenizers:
        for file in tokenizer_files(folder):
            data = file.read_bytes()
            h.update(f"{folder.name}/{file.relative_to(folder).as_posix()}:{len(data)}\n".encode())
            h.update(data)
    h.update(extra)
    return h.hexdigest()


def streamed_digest(loads: list, extra: bytes = b"") -> str:
    """:func:`weights_digest` of ``nn.ModuleList(models)`` (the FLOAT32 kind, as records before the stored
    digest hold it) with each model loaded by its ``loads[i]()`` (float32) only for its turn and dropped after:
    the host holds one at a time. Slow (it reads and upcasts every weight): only to check an old record."""

    def tensors():
        for i, load in enumerate(loads):
            state = load().state_dict()
            for name in sorted(state):
                yield f"{i}.{name}", state[name]
            del state

    if len(loads) > 10:  # "10." would sort before "2.": ModuleList's names are not in load order
        raise ValueError("streamed_digest takes at most 10 models")
    return tensors_digest(tensors(), extra)


def vocab_bytes(tokenizers: list, pairs: bool = False, ascii_only: bool = False) -> bytes:
    """The vocabularies of ``tokenizers`` as the ``extra`` of :func:`weights_digest`: each one's
    ``get_vocab()`` as a JSON object with sorted keys (``ascii_only``: non-ASCII escaped), or
    (``pairs``) as a JSON list of sorted (token, id) pairs, concatenated. Three forms because
    checkpoints already record digests made with each: CLIP's ``TextEncoder`` (an object, unescaped),
    SDXL's encoders (an object, escaped), SD3's and Flux's (pairs, unescaped)."""
    out = []
    for tokenizer in tokenizers:
        vocab = tokenizer.get_vocab()
        value = sorted(vocab.items()) if pairs else vocab
        out.append(json.dumps(value, sort_keys=not pairs, ensure_ascii=ascii_only).encode())
    return b"".join(out)


def tokenize(tokenizer, captions: list[str], length: int) -> torch.Tensor:
    """(B, length) long on the host: ``captions`` tokenized, padded to ``length`` and truncated (the
    tokenizer's own BOS / EOS kept), as the diffusers pipelines tokenize. The one tokenization of every
    text encoder (``families.base.token_ids`` adds the copy to the device)."""
    return tokenize_with_mask(tokenizer, captions, length)[0]


def tokenize_with_mask(tokenizer, captions: list[str], length: int,
                       add_special_tokens: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """((B, length) ids, (B, length) attention mask: 1 on the tokens, 0 on the padding), long, on the host:
    :func:`tokenize`'s ids and the tokenizer's mask, for the encoders the pipelines call with it (T5 in some,
    the language models). ``add_special_tokens=False``: text a chat template rendered, its special tokens in it
    (what a tokenizer's ``apply_chat_template(tokenize=True)`` does)."""
    if isinstance(captions, str):
        raise TypeError("tokenize takes a list of captions, got one string")
    out = tokenizer(list(captions), padding="max_length", max_length=length, truncation=True, return_tensors="pt",
                    add_special_tokens=add_special_tokens)
    ids = out["input_ids"].long()
    mask = out.get("attention_mask")  # a tokenizer whose model_input_names leave it out: every position counts
    return ids, torch.ones_like(ids) if mask is None else mask.long()


@contextlib.contextmanager
def quiet_loading(logging_module):
    """Hide a library's per-load progress bars and load reports (transformers' or diffusers'
    ``utils.logging``) for the duration; restored after. Missing weights are checked by the
    caller instead (:func:`check_loading_info`)."""
    enabled, verbosity = logging_module.is_progress_bar_enabled(), logging_module.get_verbosity()
    logging_module.disable_progress_bar()
    logging_module.set_verbosity_error()
    try:
        yield
    finally:
        logging_module.set_verbosity(verbosity)
        if enabled:
            logging_module.enable_progress_bar()


def check_loading_info(info: dict, what: str, folder: Path) -> None:
    """Raise ValueError when ``from_pretrained`` left tensors of the model uninitialised
    (weights of another architecture, or a truncated file)."""
    missing = list(info.get("missing_keys") or [])
    mismatched = list(info.get("mismatched_keys") or [])
    if missing or mismatched:
        names = [str(k) for k in missing + mismatched]
        raise ValueError(f"{what}: the weights in {folder} do not fit the model: {len(missing)} tensors missing, "
                         f"{len(mismatched)} of another shape (first: {names[0]})")


def first_line(e: BaseException) -> str:
    """An exception's message as one line (its type when it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class TextEncoder(nn.Module):
    """A frozen CLIP text transformer and its tokenizer: captions -> (B, L, D) embeddings.

    Attributes: ``dim`` (D, the hidden size), ``max_length`` (L, tokens per caption, BOS and
    EOS included), ``digest`` (SHA-256 of the weights and vocabulary), ``source`` (the path it
    came from). Its parameters require no grad and it stays in eval mode.
    """

    def __init__(self, model: nn.Module, tokenizer, source: str):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.source = source
        self.dim = int(model.config.hidden_size)
        self.max_length = int(model.config.max_position_embeddings)
        # of float32 weights only: a model loaded in bf16 (a family's text cache fill) is digested from its files
        is_float32 = all(p.dtype == torch.float32 for p in model.parameters())
        self.digest = weights_digest(model, vocab_bytes([tokenizer]), strip="text_model.") if is_float32 else ""

    @classmethod
    def from_path(cls, path: str, dtype: torch.dtype = torch.float32) -> TextEncoder:
        """Load on the CPU, in ``dtype`` (float32; a bf16 / fp16 one, read so from the files, has no
        ``digest``: ``families/sd.py`` takes it from the files): a CLIP text model folder (config.json,
        weights, vocab.json and merges.txt or tokenizer.json), a Stable Diffusion folder (``text_encoder/``
        and ``tokenizer/``), or ``builtin:tiny-clip``. Raises ValueError naming the folder and what
        it lacks."""
        if path.startswith(BUILTIN_PREFIX):
            name = path[len(BUILTIN_PREFIX) :]
            if name not in BUILTIN_TEXT_ENCODERS:
                choices = ", ".join(BUILTIN_PREFIX + k for k in BUILTIN_TEXT_ENCODERS)
                raise ValueError(f"text encoder {path}: unknown built-in; choices: {choices}")
            return BUILTIN_TEXT_ENCODERS[name]()
        model_dir, tokenizer_dir = text_model_folders(path)
        require("transformers", "text", f"model.text_encoder={path}")
        from transformers import CLIPTextModel, CLIPTokenizer  # transformers: an optional package ([text])
        from transformers.utils import logging

        check_weight_indexes(model_dir)  # from_pretrained reads the files a sharded model's index names, unchecked
        try:
            with quiet_loading(logging):
                tokenizer = CLIPTokenizer.from_pretrained(str(tokenizer_dir))
                model, info = CLIPTextModel.from_pretrained(str(model_dir), dtype=dtype,
                                                            output_loading_info=True)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise ValueError(f"text encoder {path}: cannot load {model_dir}: {first_line(e)}") from e
        check_loading_info(info, f"text encoder {path}", model_dir)
        return cls(model, tokenizer, path)

    def train(self, mode: bool = True) -> TextEncoder:
        """Frozen: stays in eval mode whatever a parent module asks."""
        return super().train(False)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def tokenize(self, captions: list[str]) -> torch.Tensor:
        """Token ids (B, L) long on the CPU: BOS, the caption's tokens, EOS, padded with EOS
        (or truncated, keeping EOS last) to ``max_length``. ``""`` gives BOS, EOS, padding."""
        return tokenize(self.tokenizer, captions, self.max_length)

    @torch.no_grad()
    def encode_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The last hidden state (B, L, D) float32 of token ids (B, L), on this module's device."""
        return self.model(input_ids=ids.to(self.device, non_blocking=True)).last_hidden_state.float()

    def encode(self, captions: list[str]) -> torch.Tensor:
        """``encode_ids(tokenize(captions))``: (B, L, D) float32."""
        return self.encode_ids(self.tokenize(captions))

    def forward(self, captions: list[str]) -> torch.Tensor:
        return self.encode(captions)


def text_model_folders(path: str) -> tuple[Path, Path]:
    """(model folder, tokenizer folder) of ``path``: the folder itself, or a Stable Diffusion
    folder's ``text_encoder/`` and ``tokenizer/``. ValueError naming what is missing."""
    root = Path(path).expanduser()
    if not str(path).strip():
        raise ValueError("text encoder: the path is empty")
    if not root.is_dir():
        raise ValueError(f"text encoder {path}: no such folder")
    if (root / "text_encoder").is_dir() or (root / "model_index.json").is_file():
        model_dir, tokenizer_dir = root / "text_encoder", root / "tokenizer"
        for sub in (model_dir, tokenizer_dir):
            if not sub.is_dir():
                raise ValueError(f"text encoder {path}: a Stable Diffusion folder without {sub.name}/")
    else:
        model_dir = tokenizer_dir = root
    config = model_dir / "config.json"
    if not config.is_file():
        raise ValueError(f"text encoder {path}: no config.json in {model_dir}")
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"text encoder {path}: unreadable {config}: {e}") from e
    if model_type not in TEXT_MODEL_TYPES:
        raise ValueError(f"text encoder {path}: {config} holds a {model_type!r} model, not a CLIP text model "
                         f"(model_type {' or '.join(TEXT_MODEL_TYPES)})")
    if not any((model_dir / f).is_file() for f in WEIGHT_FILES):
        raise ValueError(f"text encoder {path}: no weights in {model_dir} (looked for {', '.join(WEIGHT_FILES)})")
    has_bpe = (tokenizer_dir / "vocab.json").is_file() and (tokenizer_dir / "merges.txt").is_file()
    if not has_bpe and not (tokenizer_dir / "tokenizer.json").is_file():
        raise ValueError(f"text encoder {path}: no tokenizer files in {tokenizer_dir} "
                         "(vocab.json and merges.txt, or tokenizer.json)")
    return model_dir, tokenizer_dir


def clip_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]], max_length: int):
    """A transformers CLIPTokenizer made in memory from a vocabulary and its merges."""
    require("transformers", "text", "a text encoder (model.text_encoder)")
    from transformers import CLIPTokenizer  # transformers: an optional package ([text])

    return CLIPTokenizer(vocab=vocab, merges=list(merges), model_max_length=max_length)


def seeded_clip_weights(model: nn.Module, seed: int) -> None:
    """Overwrite every parameter of a CLIP text model from a generator seeded by ``seed``,
    in sorted name order: token embeddings N(0, 0.02), position embeddings N(0, 0.01), linear
    weights N(0, 1/fan_in), biases 0, layer-norm scales 1. Independent of how (and in what
    order) transformers initialises, so the weights are the same on any version."""
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            if name.endswith("bias"):
                p.zero_()
            elif p.ndim == 1:  # layer-norm scale
                p.fill_(1.0)
            elif "token_embedding" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            elif "position_embedding" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
            else:  # (out, in) linear weight
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def tiny_clip() -> TextEncoder:
    """``builtin:tiny-clip``: hidden 64, 2 layers, 4 heads, 16 tokens, the ``TINY_CLIP_WORDS``
    vocabulary, weights from ``TINY_CLIP_SEED`` (see :func:`seeded_clip_weights`)."""
    require("transformers", "text", "model.text_encoder=builtin:tiny-clip")
    from transformers import CLIPTextConfig, CLIPTextModel  # transformers: an optional package ([text])

    vocab, merges = word_vocabulary(TINY_CLIP_WORDS)
    config = CLIPTextConfig(vocab_size=len(vocab), bos_token_id=vocab[BOS], eos_token_id=vocab[EOS],
                            pad_token_id=vocab[EOS], **TINY_CLIP_SIZES)
    with torch.random.fork_rng(devices=[]):  # transformers' own init must not move the global RNG
        model = CLIPTextModel(config)
    seeded_clip_weights(model, TINY_CLIP_SEED)
    tokenizer = clip_tokenizer(vocab, merges, TINY_CLIP_SIZES["max_position_embeddings"])
    return TextEncoder(model, tokenizer, BUILTIN_PREFIX + "tiny-clip")


# Text encoders that need no files, selected by model.text_encoder = "builtin:NAME".
BUILTIN_TEXT_ENCODERS = {"tiny-clip": tiny_clip}


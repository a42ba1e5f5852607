"""The Gemma 2 text encoder two families share: Sana (SanaPipeline, families/sana.py) and Lumina 2
(Lumina2Pipeline, families/lumina2.py).

Facts, checked in the installed diffusers (pipeline_sana.py ``_get_gemma_prompt_embeds`` /
``encode_prompt``, pipeline_lumina2.py ``_get_gemma_prompt_embeds`` / ``encode_prompt``):

- the text encoder is a ``Gemma2Model`` (``text_encoder/``, the decoder without its LM head) and its
  ``GemmaTokenizer`` (``tokenizer/``); the prompt is put in a template first (Sana: its "complex human
  instruction" in front of the caption; Lumina 2: its system prompt + ``" <Prompt Start> "``);
- tokens padded to a fixed length (to max_length, truncated), the tokenizer's BOS kept, its
  attention mask (1 on the tokens, 0 on the padding) passed both to Gemma and on to the transformer;
- one hidden state (B, L, 2304 in Gemma 2 2B): Sana the last (``text_encoder(...)[0]``), Lumina 2 the
  second to last (``output_hidden_states=True``, ``hidden_states[-2]``);
- the negative prompt "" is encoded WITHOUT the template (neither pipeline puts it around the negative
  prompt), padded to ``max_sequence_length``: that is the null condition here (guidance's and caption
  dropout's), and a caption "" is encoded as it: an empty caption is the unconditional one.

The steps are small functions (``base.token_ids_and_mask``, :func:`gemma_states`) and one
:class:`GemmaPromptEncoder` that runs them; a family sets its template (:meth:`GemmaPromptEncoder.template`),
the hidden state it takes (``layer``), the padding side and what it keeps of the tokens
(:meth:`GemmaPromptEncoder.select`). Condition: ``{"prompt_embeds": (B, L, D), "prompt_attention_mask":
(B, L) float 0/1}`` (float32 like every condition tensor: caption dropout's ``torch.where`` and the text
cache treat it as the others; the denoisers give it to the transformers as they take it).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from difftrain.families.base import PromptEncoder, frozen_part, load_part, read_json, token_ids_and_mask
from difftrain.models.text import files_digest, vocab_bytes

KEYS = ("prompt_embeds", "prompt_attention_mask")
EMPTY = ""  # the caption encoded as the pipelines' negative prompt: no template


def gemma_length(requested: int, default: int, folder, most: int) -> int:
    """The tokens per prompt: ``requested`` (0 = the pipeline's ``default``), 1 to ``most`` (what Gemma's
    positions and the transformer take); else one ValueError naming the base."""
    length = default if requested == 0 else requested
    if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= most:
        raise ValueError(f"model.max_sequence_length={requested!r}: the base {folder} cannot take it: its Gemma "
                         f"text encoder and pipeline take 1 to {most} tokens")
    return length


def gemma_states(model, ids: Tensor, mask: Tensor, layer: int) -> Tensor:
    """(B, L, D) hidden states of Gemma at ``layer``: -1 the model's output (``model(...)[0]``, Sana's), else
    ``hidden_states[layer]`` (Lumina 2: -2), the attention mask given."""
    if layer == -1:
        return model(ids, attention_mask=mask)[0]
    return model(ids, attention_mask=mask, output_hidden_states=True).hidden_states[layer]


class GemmaPromptEncoder(PromptEncoder):
    """A Gemma 2 text encoder and its tokenizer, frozen: ``encode(captions, device) -> {"prompt_embeds":
    (B, L, D), "prompt_attention_mask": (B, L)}`` as the family's pipeline's ``encode_prompt``; "" as its
    negative prompt (no template). Subclasses set ``default_length``, ``layer``,
    ``padding_side`` (None: the tokenizer's own) and :meth:`template`. ``model.max_sequence_length`` may be
    1 to Gemma's ``max_position_embeddings``."""

    parts = ("gemma",)
    default_length = 256
    layer = -1
    padding_side: str | None = None

    def __init__(self, folder: Path, max_sequence_length: int = 0, deferred: bool = False):
        super().__init__()
        from transformers import Gemma2Model, GemmaTokenizer  # optional ([text])

        self.source = str(folder)
        self.add_part("gemma", folder / "text_encoder", frozen_part(folder, "text_encoder", Gemma2Model,
                                                                    "Gemma 2 text encoder"), deferred)
        self.tokenizer = load_part(folder, "tokenizer", GemmaTokenizer, "Gemma tokenizer")
        if self.padding_side is not None:
            self.tokenizer.padding_side = self.padding_side  # as the pipeline sets it
        config = read_json(folder / "text_encoder" / "config.json", f"base {folder}")
        self.length = gemma_length(max_sequence_length, self.default_length, folder,
                                   int(config.get("max_position_embeddings", 8192)))
        self.width = int(config["hidden_size"])
        self.digest = files_digest([folder / "text_encoder"], [folder / "tokenizer"], self._extra().encode())

    def _extra(self) -> str:
        """What enters the condition besides the files: the length, the layer, the template."""
        texts, length = self.template(["{}"])
        return f"length={self.length},layer={self.layer},padding={self.padding_side},template={texts[0]!r},{length}"

    def legacy_extra(self) -> bytes:
        return vocab_bytes([self.tokenizer], pairs=True) + self._extra().encode()

    @property
    def dim(self) -> int:
        """The width of ``prompt_embeds`` (Gemma's hidden_size)."""
        return self.width

    def preprocess(self, captions: list[str]) -> list[str]:
        """The captions as the pipeline reads them before the template (Lumina 2: as they are)."""
        return list(captions)

    def template(self, captions: list[str]) -> tuple[list[str], int]:  # pragma: no cover - interface
        """(the texts Gemma reads for ``captions``, the length they are padded to)."""
        raise NotImplementedError(type(self).__name__)

    def select(self, states: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """The tokens of the templated prompts kept (Sana keeps BOS and the last L - 1); all by default."""
        return states, mask

    def _run(self, texts: list[str], length: int, templated: bool) -> tuple[Tensor, Tensor]:
        model = self.gemma
        ids, mask = token_ids_and_mask(self.tokenizer, texts, length, model.device)
        states = gemma_states(model, ids, mask, self.layer)
        return self.select(states, mask) if templated else (states, mask)

    def encode_part(self, name: str, captions: list[str]) -> dict[str, Tensor]:
        """``{"prompt_embeds": (B, L, D), "prompt_attention_mask": (B, L)}`` of Gemma: the captions in the
        template, "" without it (the pipeline's negative prompt), each row in its place."""
        captions = self.preprocess(captions)
        empty = [i for i, c in enumerate(captions) if c == EMPTY]
        full = [i for i, c in enumerate(captions) if c != EMPTY]
        parts = []
        if full:
            texts, length = self.template([captions[i] for i in full])
            parts.append((full, *self._run(texts, length, True)))
        if empty:
            parts.append((empty, *self._run([EMPTY] * len(empty), self.length, False)))
        if len(parts) == 1:
            return {"prompt_embeds": parts[0][1], "prompt_attention_mask": parts[0][2]}
        order = torch.tensor([i for rows, _, _ in parts for i in rows]).argsort()
        states = torch.cat([s for _, s, _ in parts])[order.to(parts[0][1].device)]
        mask = torch.cat([m for _, _, m in parts])[order.to(parts[0][2].device)]
        return {"prompt_embeds": states, "prompt_attention_mask": mask}

    def assemble(self, outputs: dict[str, dict[str, Tensor]], device: torch.device | str) -> dict[str, Tensor]:
        out = outputs["gemma"]
        return {"prompt_embeds": out["prompt_embeds"].float().to(device),
                "prompt_attention_mask": out["prompt_attention_mask"].float().to(device)}

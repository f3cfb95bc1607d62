"""Tokenizer (the Rust ``tokenizers`` library), chat template (jinja2), incremental detokenizer."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import meta
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.decoders import DecodeStream

from common import tool_prompt
from common.gguf_loader import GGUFFile

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


class ChatTemplateError(ValueError):
    """The messages cannot be rendered with the model's chat template."""


class TextTokenizer:
    """Text ↔ token ids for one model, plus its chat template.

    Thread-safe for ``encode``/``decode`` (the Rust tokenizer is); ``apply_chat_template`` is pure.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        add_bos: bool,
    ) -> None:
        self.tk = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = add_bos
        self.bos_id = tokenizer.token_to_id(bos_token) if bos_token else None
        # the special tokens' ids: with skip_special_tokens they add no text (IncrementalDetokenizer skips them)
        self.special_ids = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        self._template = None
        self.renders_tools = False  # whether the template takes ``tools`` (else common/tool_prompt.py writes them)
        if chat_template:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(chat_template)
            self.renders_tools = "tools" in meta.find_undeclared_variables(env.parse(chat_template))

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    # -- construction ----------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, g: GGUFFile) -> TextTokenizer:
        md = g.metadata
        kind = md.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"{g.path}: tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' is)")
        tokens: list[str] = md["tokenizer.ggml.tokens"]
        types = md.get("tokenizer.ggml.token_type")
        merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
        vocab = {t: i for i, t in enumerate(tokens)}
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tk.decoder = decoders.ByteLevel()
        if types is not None:
            special = [
                AddedToken(tokens[i], special=True, normalized=False)
                for i, t in enumerate(types)
                if t in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
            ]
            tk.add_special_tokens(special)

        def tok(key: str) -> str | None:
            i = md.get(key)
            return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

        return cls(
            tk,
            md.get("tokenizer.chat_template"),
            tok("tokenizer.ggml.bos_token_id"),
            tok("tokenizer.ggml.eos_token_id"),
            bool(md.get("tokenizer.ggml.add_bos_token", False)),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> TextTokenizer:
        p = Path(path)
        tk = Tokenizer.from_file(str(p / "tokenizer.json"))
        cfg: dict[str, Any] = {}
        if (p / "tokenizer_config.json").is_file():
            cfg = json.loads((p / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if (p / "chat_template.jinja").is_file():
            template = (p / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take the default
            template = next((t["template"] for t in template if t.get("name") == "default"), None)

        def name(v: Any) -> str | None:
            return v.get("content") if isinstance(v, dict) else v

        return cls(tk, template, name(cfg.get("bos_token")), name(cfg.get("eos_token")), bool(cfg.get("add_bos_token", False)))

    # -- encode / decode -------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tk.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        encs = self.tk.encode_batch(list(texts), add_special_tokens=False)
        out = [e.ids for e in encs]
        if add_special_tokens and self.add_bos and self.bos_id is not None:
            out = [ids if ids and ids[0] == self.bos_id else [self.bos_id, *ids] for ids in out]
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        tool_format: tool_prompt.Style = "hermes",
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` (and OpenAI's ``tools``) with the model's template; a template that does not take
        ``tools`` gets them, and the tool turns, written in ``tool_format`` by ``common/tool_prompt.py``. Raises
        ChatTemplateError on bad messages."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        if not messages:
            raise ChatTemplateError("messages must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise ChatTemplateError(f"messages[{i}] must be an object with a 'role'")
            if not isinstance(m.get("content", ""), str | list | None):
                raise ChatTemplateError(f"messages[{i}].content must be a string or a list of parts")
        msgs = [_flatten_content(m) for m in messages]
        if self.renders_tools:
            if tools:
                kwargs["tools"] = tools
        elif tools or tool_prompt.has_tool_turns(msgs):
            msgs = tool_prompt.with_tools(msgs, tools, tool_format)
        try:
            return self._template.render(
                messages=msgs,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e

    def detokenizer(self, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


def _flatten_content(m: dict[str, Any]) -> dict[str, Any]:
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ChatTemplateError("only text content parts are supported")
            texts.append(str(part.get("text", "")))
        return {**m, "content": "".join(texts)}
    if content is None:
        return {**m, "content": ""}
    return m


def _raise(message: str) -> None:
    raise TemplateError(message)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, never splitting a UTF-8 character.

    Prefilled with the prompt's last tokens so the first generated token decodes with its left context
    (byte-level BPE spacing). Not thread-safe: one per sequence.

    With ``skip_special_tokens`` a special token is not fed to the decode stream: it adds no text, and the stream,
    which waits for a token that adds text before it moves its window on, would re-decode a run of them from its
    start at every step (a run of n costs O(n²) decodes).
    """

    _PREFILL_CONTEXT = 6

    def __init__(self, tok: TextTokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tk = tok.tk
        ctx = list(prompt_ids[-self._PREFILL_CONTEXT :])
        self._stream = DecodeStream(ids=ctx, skip_special_tokens=skip_special_tokens)
        self._skip: frozenset[int] = tok.special_ids if skip_special_tokens else frozenset()
        self.text = ""

    def step(self, token_id: int) -> str:
        """Feed one token; returns the new text (possibly empty while a character is incomplete)."""
        if token_id in self._skip:
            return ""
        delta = self._stream.step(self._tk, token_id)
        if delta:
            self.text += delta
            return delta
        return ""

"""Tokenizer: a thin wrapper over ``tokenizers.Tokenizer`` plus HF-style chat templates.

A checkpoint directory holds ``tokenizer.json`` (HF tokenizers format) and
``tokenizer_config.json`` (chat template, special token names), and optionally
``chat_template.jinja`` (newer transformers write the template there; it wins
over tokenizer_config.json's, as in transformers), ``special_tokens_map.json``
(older checkpoints name their special tokens there), ``config.json`` and
``generation_config.json`` (extra EOS ids, e.g. Llama-3's ``<|eot_id|>``).
Whether BOS is added to a raw prompt is ``tokenizer.json``'s post-processor's
choice (transformers 5 ignores ``add_bos_token`` for such tokenizers too).
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Mapping, Sequence

from hetero_jax.errors import CheckpointError, PromptError


def _token_content(tok: Any) -> str | None:
    """A special token as stored in tokenizer_config.json: a string or an AddedToken dict."""
    if tok is None:
        return None
    if isinstance(tok, Mapping):
        return tok.get("content")
    return str(tok)


def check_special_tokens(entries: Mapping[str, Any], path: str, fix: str) -> None:
    """Refuse a special-token entry of ``path`` (tokenizer_config.json, special_tokens_map.json) that is not a
    token's text: a string, an AddedToken object with a string "content", or null. An id written there
    (``"eos_token": 5``) would otherwise make the token spelled "5" an EOS; transformers refuses it too."""
    for key in SPECIAL_TOKENS:
        value = entries.get(key)
        if value is None or isinstance(value, str):
            continue
        if isinstance(value, Mapping) and isinstance(value.get("content"), str):
            continue
        raise CheckpointError(f"{path}: {key} = {json.dumps(value)[:80]} is not a token's text (a string, or an "
                              f"object with a string \"content\"); write the token itself, e.g. \"</s>\", or "
                              f"{fix}")


DAMAGED_FIX = "re-create or re-download it"  # what a damaged tokenizer file's error says by default
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _file_bytes(path: str, fix: str, data: bytes | None) -> bytes:
    """``data`` when the caller already read the file ``path``, else its bytes; CheckpointError naming ``path``
    and ``fix`` when it cannot be read."""
    if data is not None:
        return data
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({e.strerror or e}); {fix}") from None


def json_object(path: str, fix: str, data: bytes | None = None) -> dict:
    """The JSON object in the file ``path`` (``data``: its bytes, when already read); CheckpointError naming
    ``path`` and ``fix`` when it is not UTF-8 JSON or holds something other than an object."""
    try:
        doc = json.loads(_file_bytes(path, fix, data).decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not a valid JSON object ({e}); {fix}") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path} is not a valid JSON object (it holds a JSON {type(doc).__name__}, not an "
                              f"object); {fix}")
    return doc


def _is_token_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def check_token_ids(doc: Mapping[str, Any], path: str, fix: str) -> None:
    """Refuse (CheckpointError naming ``path`` and ``fix``) a config.json / generation_config.json object whose
    ``eos_token_id`` is not a token id (an integer >= 0), a list of them or null, or whose ``bos_token_id`` is
    not a token id or null: the forms transformers reads."""
    eos, bos = doc.get("eos_token_id"), doc.get("bos_token_id")
    if eos is not None and not (_is_token_id(eos) or isinstance(eos, list) and all(map(_is_token_id, eos))):
        raise CheckpointError(f"{path}: eos_token_id is {eos!r}; it must be a token id (an integer >= 0), a list "
                              f"of them or null; {fix}")
    if bos is not None and not _is_token_id(bos):
        raise CheckpointError(f"{path}: bos_token_id is {bos!r}; it must be a token id (an integer >= 0) or null; "
                              f"{fix}")


def read_chat_template(path: str, fix: str, data: bytes | None = None) -> str:
    """The text of the chat-template file ``path`` (``data``: its bytes, when already read); CheckpointError
    naming it and ``fix`` when it is not UTF-8."""
    try:
        return _file_bytes(path, fix, data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path} is not UTF-8 text ({e}); {fix}") from None


def check_chat_template_entry(template: Any, path: str, fix: str) -> None:
    """Refuse (CheckpointError naming ``path`` and ``fix``) a ``chat_template`` entry that is neither a string,
    null nor HF's named-template list ``[{"name": str, "template": str}, ...]``."""
    if template is None or isinstance(template, str):
        return
    if not (isinstance(template, list) and all(
            isinstance(t, Mapping) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
            for t in template)):
        raise CheckpointError(f"{path}: chat_template is a JSON {type(template).__name__} that is neither a template "
                              'string nor a list of {"name": ..., "template": ...} objects; ' + fix)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Same signature and defaults as transformers' chat-template ``tojson`` filter
    # (jinja's built-in one HTML-escapes and sorts keys, which changes the prompt).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


class _TemplateDict:
    """``dict`` in a chat template: calls and ``fromkeys`` only, no attribute route to the class (transformers')."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _template_namespace():
    """``namespace`` in a chat template: jinja's, refusing underscore-prefixed names (transformers' guard)."""
    from jinja2.exceptions import SecurityError
    from jinja2.utils import Namespace

    def check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot store underscore-prefixed attributes on a namespace, but "
                                f"got {name!r}")

    class TemplateNamespace(Namespace):
        def __init__(*args, **kwargs):  # jinja's signature trick, so namespace(self=...) still works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            check(name)
            Namespace.__setitem__(self, name, value)

    return TemplateNamespace


def _generation_extension():
    """The ``{% generation %}...{% endgeneration %}`` block of transformers' chat templates (it marks the
    assistant's tokens for training masks): rendered as its body, which is all a prompt needs."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationBlock


def compile_chat_template(source: str):
    """The jinja ``Template`` of the chat-template text ``source``, in the environment transformers uses for chat
    templates (its extensions, filters and globals, so prompts match byte for byte). Nothing is rendered. A syntax
    error, or a filter or test the environment lacks outside a conditional block, is a
    ``jinja2.TemplateSyntaxError``; one inside an ``{% if %}`` fails only when that branch renders, as in
    transformers (a branch a prompt never takes, e.g. tools, must not make the whole template unusable)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_extension(), loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _template_namespace()
    return env.from_string(source)


def jinja_problem(e) -> str:
    """What a ``jinja2.TemplateSyntaxError`` says of the template, to follow "the chat template"."""
    return f"is not valid Jinja (line {e.lineno}: {e.message})"


def checked_chat_template(source: str, where: str, what: str, *, converting: bool = False):
    """:func:`compile_chat_template` of ``source``; one that does not compile is a CheckpointError naming
    ``where`` it came from and ``what`` to fix (the loader's and, with ``converting``, the converter's check, so
    a checkpoint is never written with a template that every load refuses)."""
    from jinja2 import TemplateSyntaxError

    try:
        return compile_chat_template(source)
    except TemplateSyntaxError as e:
        if converting:
            raise CheckpointError(f"the model's chat template {jinja_problem(e)}, in {where}; fix {what} and "
                                  "convert again (or remove it: the checkpoint then has no chat template and is "
                                  "prompted raw, chat=False / --no-chat)") from None
        raise CheckpointError(f"the checkpoint's chat template {jinja_problem(e)}, in {where}; fix {what}, or "
                              "remove it and pass chat=False (CLI: --no-chat) to use the raw prompt") from None


def default_chat_template(entry) -> tuple[str | None, list[str]]:
    """The chat template of a tokenizer_config.json ``chat_template`` entry: a string is it; in HF's named form
    [{"name": ..., "template": ...}] the one named "default" (the last such, as transformers builds a dict of
    them). Also the sorted names when a named list has no "default" (transformers refuses to pick), else []."""
    if not isinstance(entry, list):
        return entry or None, []
    named = {t.get("name"): t.get("template") for t in entry if isinstance(t, Mapping)}
    template = named.get("default")
    return template or None, [] if template is not None else sorted(str(n) for n in named)


def template_error(problem: str) -> PromptError:
    """The error for a chat template that cannot render a prompt: the problem and both ways out."""
    return PromptError(f"the checkpoint's chat template {problem}; pass chat=False (CLI: --no-chat) to use the "
                       "raw prompt, or fix chat_template in the checkpoint's tokenizer_config.json (or "
                       "chat_template.jinja)")


def _preview(text: str, n: int = 40) -> str:
    text = text.strip()
    return repr(text if len(text) <= n else text[:n] + "...")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_SETTLE_WINDOW = 4096  # characters at a text's end that ``Tokenizer.settled_length`` looks at


def check_unicode(text: str, what: str) -> None:
    """PromptError naming ``what`` when ``text`` holds a lone surrogate, which no tokenizer can encode: a byte
    that was not UTF-8, as Python reads it from a command line, a terminal or a file opened with
    ``errors="surrogateescape"`` (U+DC80-U+DCFF stand for bytes 0x80-0xFF)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = text[e.start]
        byte = f" (the byte 0x{ord(ch) - 0xDC00:02x})" if 0xDC80 <= ord(ch) <= 0xDCFF else ""
        raise PromptError(f"{what} is not valid text: character {e.start} is the lone surrogate "
                          f"U+{ord(ch):04X}{byte}, which is what a byte that is not UTF-8 becomes; give UTF-8 "
                          "text (decode the bytes with their real encoding, e.g. latin-1)") from None


class Tokenizer:
    """Text <-> token ids, special token ids and the chat template of one model."""

    # decoding ids[i:] gives the text of ids from token i on, when token i begins a character (a leading space of
    # the first token aside): HF's decoders (byte-level, byte fallback, metaspace) join per-token pieces, so an
    # answer streams by decoding its last tokens only (``runtime.streaming.AnswerText``)
    suffix_decodable = True

    def __init__(self, backend, *, tokenizer_config: Mapping[str, Any] | None = None,
                 chat_template: str | None = None, extra_eos_token_ids: Sequence[int] = (),
                 bos_token_id: int | None = None):
        """``backend``: a ``tokenizers.Tokenizer``; ``extra_eos_token_ids``: EOS ids from config.json."""
        self._tok = backend
        self.tokenizer_config = dict(tokenizer_config or {})
        tc = self.tokenizer_config
        self.bos_token = _token_content(tc.get("bos_token"))
        self.eos_token = _token_content(tc.get("eos_token"))
        self.pad_token = _token_content(tc.get("pad_token"))
        self.unk_token = _token_content(tc.get("unk_token"))

        # without a "default" among named templates apply_chat_template refuses (the names kept for its message)
        self.chat_template, self._template_names = default_chat_template(
            chat_template if chat_template is not None else tc.get("chat_template"))

        bos = self.token_to_id(self.bos_token) if self.bos_token else None
        self.bos_token_id: int | None = bos if bos is not None else bos_token_id
        eos: list[int] = []
        if self.eos_token is not None and self.token_to_id(self.eos_token) is not None:
            eos.append(self.token_to_id(self.eos_token))
        for e in extra_eos_token_ids:
            if int(e) not in eos:
                eos.append(int(e))
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        pad = self.token_to_id(self.pad_token) if self.pad_token else None
        # No pad token declared: fall back to the first EOS id (what HF generate does).
        self.pad_token_id: int | None = pad if pad is not None else (eos[0] if eos else None)
        self._template_fn = None

    # ----------------------------------------------------------------- loading
    @classmethod
    def from_dir(cls, path: str | os.PathLike, *, fix: str = DAMAGED_FIX) -> "Tokenizer":
        """Load ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``chat_template.jinja``,
        ``special_tokens_map.json``, ``config.json``, ``generation_config.json``) as transformers reads them.
        ``fix``: what the CheckpointError for a damaged file tells the user to do. The chat template is compiled
        (not rendered) and kept: a broken one is a CheckpointError naming its file."""
        from tokenizers import Tokenizer as _HFTokenizer

        path = os.fspath(path)
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise CheckpointError(f"no tokenizer.json in {path}; a checkpoint needs the HF tokenizers file ({fix})")
        try:
            backend = _HFTokenizer.from_file(tj)
        except Exception as e:  # tokenizers raises a bare Exception on parse errors
            raise CheckpointError(f"cannot read {tj} ({e}); it is corrupt or not an HF tokenizers file; "
                                  f"{fix}") from None
        tc_path = os.path.join(path, "tokenizer_config.json")
        tc = json_object(tc_path, fix) if os.path.isfile(tc_path) else {}
        check_chat_template_entry(tc.get("chat_template"), tc_path, fix)
        check_special_tokens(tc, tc_path, fix)
        template = None
        jinja_path = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_path):  # a separate template file wins over tokenizer_config.json's, as in HF
            template = read_chat_template(jinja_path, fix)
        map_path = os.path.join(path, "special_tokens_map.json")
        if "added_tokens_decoder" not in tc and os.path.isfile(map_path):
            # transformers' legacy layout: special_tokens_map.json's entries override tokenizer_config.json's
            special = json_object(map_path, fix)
            check_special_tokens(special, map_path, fix)
            tc.update({k: special[k] for k in SPECIAL_TOKENS if k in special})
        extra_eos: list[int] = []
        bos_id = None
        # EOS ids beyond tokenizer_config's eos_token (e.g. Llama-3-Instruct's <|eot_id|>) live in
        # config.json and generation_config.json.
        for name in ("config.json", "generation_config.json"):
            cfg_path = os.path.join(path, name)
            if os.path.isfile(cfg_path):
                cfg = json_object(cfg_path, fix)
                check_token_ids(cfg, cfg_path, fix)
                e = cfg.get("eos_token_id")
                extra_eos += [] if e is None else list(e) if isinstance(e, list) else [e]
                if bos_id is None:
                    bos_id = cfg.get("bos_token_id")
        tok = cls(backend, tokenizer_config=tc, chat_template=template,
                  extra_eos_token_ids=extra_eos, bos_token_id=bos_id)
        if tok.chat_template:  # compiled now and kept for the renders: a broken one is refused at load
            jinja = template is not None
            tok._template_fn = checked_chat_template(
                tok.chat_template, jinja_path if jinja else f"{tc_path}'s chat_template",
                "the checkpoint's chat_template.jinja" if jinja else
                "chat_template in the checkpoint's tokenizer_config.json")
        return tok

    # ------------------------------------------------------------------- basics
    @property
    def backend(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(int(i))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs the post-processor (e.g. adds BOS). PromptError
        for text that is not valid Unicode (:func:`check_unicode`)."""
        check_unicode(text, "the text")
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def settled_length(self, text: str, start: int = 0) -> int:
        """The length of the longest prefix of ``text`` (at least ``start``) whose tokens no continuation can
        change: it ends before the last two pre-tokens (a continuation can merge the last one with what follows,
        e.g. a trailing space with a newline; regex splitting leaves the ones before it as they are). ``start``
        when the tokenizer has no pre-tokenizer or no such prefix splits as the whole text does."""
        pre = self._tok.pre_tokenizer
        if pre is None or self._tok.normalizer is not None:  # offsets would not be the text's
            return start
        # the text's end only (a long context's every pre-token would be a Python tuple): where the window
        # starts mid-piece, both sides of the check below start there alike
        w0 = max(0, len(text) - _SETTLE_WINDOW)
        tail = text[w0:]
        pieces = pre.pre_tokenize_str(tail)
        if len(pieces) < 3:
            return start
        cut = max(start - w0, pieces[-2][1][0])
        if cut >= len(tail) or self.encode(tail[:cut]) + self.encode(tail[cut:]) != self.encode(tail):
            return start
        return w0 + cut

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------ chat template
    def _compiled_template(self):
        """The chat template compiled (once: at load by :meth:`from_dir`, else at the first render)."""
        if self._template_fn is None:
            from jinja2 import TemplateSyntaxError

            try:
                self._template_fn = compile_chat_template(self.chat_template)
            except TemplateSyntaxError as e:
                raise template_error(jinja_problem(e)) from None
        return self._template_fn

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}, ...]) with the model's chat template.

        A template that does not compile, fails or refuses the conversation (``raise_exception``), or leaves a
        user message's text out of the prompt (truncated, dropped) is a PromptError naming the problem, raised
        before any compute."""
        if not self.chat_template and self._template_names:
            raise template_error(f"is a list of named templates ({', '.join(self._template_names)}) with none named "
                                 "'default', so none is the chat template (transformers refuses it too)")
        if not self.chat_template:
            raise PromptError(
                "this checkpoint has no chat template; pass chat=False (CLI: --no-chat) to use the raw prompt"
            )
        ctx = dict(
            tools=None,  # what transformers passes when none are given: templates test them against none
            documents=None,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
            unk_token=self.unk_token or "",
        )
        ctx.update(kwargs)
        template = self._compiled_template()
        from jinja2 import TemplateError

        try:
            rendered = template.render(**ctx)
        except TemplateError as e:  # raise_exception(...), an undefined name, a sandbox refusal
            raise template_error(f"refused the conversation ({type(e).__name__}: {e})") from None
        except Exception as e:  # the template's own code failing (a bad filter argument, an index error...)
            raise template_error(f"failed while rendering ({type(e).__name__}: {e})") from None
        for m in messages:
            user = isinstance(m, Mapping) and m.get("role") == "user" and isinstance(m.get("content"), str)
            content = m["content"] if user else ""
            # templates often trim the content (Llama-3) and a few write it as JSON (escaped); anything else
            # missing was dropped or truncated
            if user and content.strip() not in rendered and _tojson(content.strip())[1:-1] not in rendered:
                raise template_error("leaves the user's message out of the prompt (truncated or dropped: "
                                     f"{_preview(content)} is not in what it rendered)")
        return rendered

    def encode_prompt(self, text: str, chat: bool = True) -> list[int]:
        """Prompt ids: chat -> one user turn through the chat template; else raw text + specials (BOS)."""
        if chat:
            rendered = self.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            # The template writes every special token itself.
            return self.encode(rendered, add_special_tokens=False)
        return self.encode(text, add_special_tokens=True)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
                f"eos_token_ids={self.eos_token_ids}, chat_template={'yes' if self.chat_template else 'no'})")

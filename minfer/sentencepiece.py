"""SentencePiece BPE vocabularies from GGUF files (`tokenizer.ggml.model == "llama"`) as a `tokenizers` BPE.

A GGUF stores such a vocabulary as tokens, scores and token types, with no merges. Every split of a
token into two vocabulary pieces becomes a merge, ranked by the token's score (by its position for
Gemma, whose scores do not follow its merge order). Characters outside the vocabulary fall back to
their UTF-8 bytes (`<0xNN>` tokens). The pipeline matches what transformers builds for the same file:
Llama-style vocabularies use a Metaspace pre-tokenizer, Gemma and Phi-3 a normalizer that spells spaces
as '▁'.
"""
from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from .errors import MinferError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # tokenizer.ggml.token_type
GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
NORMALIZER_ARCHS = GEMMA_ARCHS + ("phi3",)  # spaces become '▁' in a normalizer, not a Metaspace pre-tokenizer
SPACE = "\u2581"  # '▁', SentencePiece's spelling of a space


def build_sentencepiece(tokens: list[str], scores: list[float] | None, token_types: list[int] | None, *,
                        add_space_prefix: bool = True, arch: str = "llama", unk_id: int | None = None,
                        special_ids=()) -> Tokenizer:
    """The tokenizer for a SentencePiece vocabulary. unk_id: the file's unknown token (else the first of
    type UNKNOWN); special_ids: ids it names as bos/eos/unk/pad, kept whole in text and skipped on decode
    like the control tokens."""
    types = list(token_types) if token_types is not None else [NORMAL] * len(tokens)
    gemma = arch in GEMMA_ARCHS
    respelled = set()
    if gemma:
        # Gemma files store runs of spaces as real spaces; the normalized text spells them '▁▁'.
        respelled = {i for i, t in enumerate(tokens) if t and not t.strip(" ")}
        tokens = [SPACE * len(t) if i in respelled else t for i, t in enumerate(tokens)]
        rank = {t: -i for i, t in enumerate(tokens)}
    else:
        rank = dict(zip(tokens, scores if scores is not None else [-i for i in range(len(tokens))]))
    vocab = {t: i for i, t in enumerate(tokens)}
    if unk_id is None:
        unk_id = next((i for i, ty in enumerate(types) if ty == UNKNOWN), None)
    unk = tokens[unk_id] if unk_id is not None else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(vocab, rank), unk_token=unk, fuse_unk=True,
                               byte_fallback=True))

    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if arch in NORMALIZER_ARCHS:
        # Every space becomes '▁' before BPE (the prefix '▁' too, before each text piece); no split.
        tok.normalizer = normalizers.Replace(" ", SPACE)
        if add_space_prefix:
            tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), tok.normalizer])
    else:
        # Spaces become '▁'; the prefix '▁' goes only at the very start, and not if a space is already there.
        scheme = "first" if add_space_prefix else "never"
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme=scheme, split=False)
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1))  # the prefix space is not part of the text
    tok.decoder = decoders.Sequence(steps)

    special = {i for i, ty in enumerate(types) if ty in (CONTROL, UNKNOWN)} | {i for i in special_ids if i is not None}
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special)])
    # User-defined pieces match whole in the raw text; respelled space runs are left to BPE.
    skip = special | respelled
    user = [t for i, (t, ty) in enumerate(zip(tokens, types)) if ty == USER_DEFINED and i not in skip and vocab.get(t) == i]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tok


def _merges(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """Each split of a token into two vocabulary pieces, best-ranked token first; ties: longer left piece
    first, then longer right piece, then vocabulary order (transformers' order for the same file)."""
    found = []
    for tok, r in rank.items():
        found += [(r, tok[:k], tok[k:]) for k in range(1, len(tok)) if tok[:k] in vocab and tok[k:] in vocab]
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)  # stable: ties keep vocabulary order
    return [(a, b) for _, a, b in found]


# Gemma's chat format, for files that carry no tokenizer.chat_template: Google's template for text (that of
# gemma-3-*-it): a system message joins the first user turn; the model's turns are 'model'; the turns after the
# system message alternate user, model, user, ... (as in Google's template, anything else is an error).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] + '\n\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for m in turns -%}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n'"
    " + (prefix if loop.first else '') + m['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def from_gguf_fields(field) -> tuple[Tokenizer, dict]:
    """The tokenizer and its metadata from a GGUF's fields; field(key, default) reads one."""
    ids = [field(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")]
    tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    if not tokens:
        raise MinferError("GGUF tokenizer (llama) lacks tokenizer.ggml.tokens")
    arch = field("general.architecture", "llama")
    tok = build_sentencepiece(tokens, field("tokenizer.ggml.scores"), types,
                              add_space_prefix=bool(field("tokenizer.ggml.add_space_prefix", True)),
                              arch=arch, unk_id=ids[2], special_ids=ids)
    meta = {
        "chat_template": field("tokenizer.chat_template") or (GEMMA_CHAT_TEMPLATE if arch in GEMMA_ARCHS else None),
        "bos_token_id": ids[0],
        "eos_token_id": ids[1],
        # llama.cpp and transformers add BOS to a SentencePiece vocabulary unless the file says not to.
        "add_bos_token": bool(field("tokenizer.ggml.add_bos_token", True)),
        "control_tokens": [t for t, ty in zip(tokens, types or []) if ty == CONTROL],
    }
    return tok, meta

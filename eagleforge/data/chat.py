"""Chat tokenization: a conversation -> (input_ids, loss_mask) through the target's chat template.

Loss mask: exactly the assistant tokens, i.e. each assistant message's content plus the
special token the chat template puts right after it (the end of turn, e.g. <|im_end|> or
<|eot_id|>), never the role header. Spans are found in the rendered text (prefix renders with
add_generation_prompt) and mapped to tokens through the fast tokenizer's offsets.

Reasoning: a last assistant message with `reasoning_content` (a thinking model's answer from a
server) is rendered as it was served: the template's render of the turns before it with the
generation prompt, then what the model generated, <think>reasoning</think>content (the opening
tag left out when the generation prompt ends with it, as Kimi-K2.5's does), then the template's
end of turn; the mask covers all the generated text. Not the template's render of the whole
conversation: templates render a finished turn as history, and Kimi-K2.5's (like DeepSeek-R1's)
blanks the reasoning of history turns, so the draft would never see the tokens the target
spends most of its time generating. Earlier assistant turns keep the template's history render.

Special-token text: the tokenizer turns the text of a special token (e.g. "<|im_end|>") into
its id wherever it stands, so an answer or a prompt holding "<|im_end|>\n<|im_start|>user\n..."
would become a fake turn of real control tokens, inside the loss mask. Message text never
becomes special ids: data.special_text=refuse (the default) drops such a sample
(screen_special_text, counted), encode tokenizes those messages' text as plain text (the
template's own special tokens stay special).
"""

from __future__ import annotations

import bisect
import functools
import logging
import re

from eagleforge.errors import UserInputError

log = logging.getLogger(__name__)


class TemplateMismatch(ValueError):
    """The chat template does not reproduce an assistant message verbatim (it rewrites it)."""


# The tags vLLM's and SGLang's reasoning parsers strip (deepseek_r1, qwen3, kimi_k2, ...): a
# thinking model generates <think>reasoning</think>content.
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# A content no template rewrites (no spaces to trim, no tags), to find where a turn's content ends.
_PROBE = "EagleforgeEndOfTurnProbe"
# Probes standing for message i's text, to find where the template puts each (_probed_render).
_TEXT_PROBE = "EagleforgeText{}Probe"
_TEXT_PROBES = re.compile(r"EagleforgeText(\d+)Probe")
TEXT_KEYS = ("content", "reasoning_content")  # a message's own text, as chat rows and replies carry it
SPECIAL_TEXT_REASON = "special_token_text_in_message"  # stats.json's reason for a refused sample


# ----------------------------------------------------------------------------------------------
# Chat template and loss mask


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _try_prefix(tokenizer, messages: list[dict]) -> str | None:
    """The render of `messages` followed by the assistant header, or None if the template refuses."""
    from jinja2 import TemplateError

    try:
        return render_chat(tokenizer, messages, True)
    except (TemplateError, IndexError, KeyError, TypeError, ValueError):
        return None  # e.g. a template that reads messages[0] of an empty list


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, [(start, end)] character span of each assistant message's content);
    a last assistant message with reasoning is rendered as served (_served_spans)."""
    if messages and messages[-1]["role"] == "assistant" and messages[-1].get("reasoning_content"):
        return _served_spans(tokenizer, messages)
    return _template_spans(tokenizer, messages)


def served_answer(prompt_text: str, reasoning: str, content: str) -> str:
    """The text a thinking model generated after `prompt_text` (a render with the generation
    prompt), rebuilt from the server's split into reasoning and content."""
    opened = prompt_text.rstrip().endswith(THINK_OPEN)  # the template opened the block for the model
    return ("" if opened else THINK_OPEN) + reasoning + THINK_CLOSE + content


def _served_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The conversation with its last assistant turn (which has reasoning) as it was served:
    render(turns before it, generation prompt) + served_answer + the template's end of turn;
    its span covers the whole served answer. Earlier assistant turns: the template's spans."""
    *head, last = messages
    prompt = render_chat(tokenizer, head, True)
    head_spans: list[tuple[int, int]] = []
    if any(m["role"] == "assistant" for m in head):
        head_text, head_spans = _template_spans(tokenizer, head)
        if not prompt.startswith(head_text):
            raise TemplateMismatch("the chat template's generation prompt does not extend its render of the earlier turns")
    # What the template puts after an assistant turn's content (e.g. <|im_end|>\n), from a render
    # whose last content is a probe word.
    probe = {k: v for k, v in last.items() if k != "reasoning_content"} | {"content": _PROBE}
    probe_text = render_chat(tokenizer, head + [probe], False)
    if _PROBE not in probe_text:
        raise TemplateMismatch(f"the chat template does not reproduce assistant message {len(head)} verbatim")
    end_of_turn = probe_text[probe_text.rindex(_PROBE) + len(_PROBE):]
    answer = served_answer(prompt, last["reasoning_content"], last["content"])
    return prompt + answer + end_of_turn, head_spans + [(len(prompt), len(prompt) + len(answer))]


def _template_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(the template's render, [(start, end)] character span of each assistant message's content).

    The content of assistant message i starts where the render of messages[:i] with the
    generation prompt ends, when that render is a prefix of the full one (true for ChatML,
    Llama-3, Kimi and most templates). Otherwise, or when the template trims the content, the
    content (or its stripped form) is searched after the previous span.
    """
    text = render_chat(tokenizer, messages, False)
    spans, cursor = [], 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        candidates = [c for c in dict.fromkeys((message["content"], message["content"].strip()))]
        start = found = None
        prefix = _try_prefix(tokenizer, messages[:index]) if index else None
        if prefix is not None and len(prefix) >= cursor and text.startswith(prefix):
            found = next((c for c in candidates if text.startswith(c, len(prefix))), None)
            start = len(prefix) if found is not None else None
        if start is None:
            for c in candidates:
                position = text.find(c, cursor) if c else -1
                if position >= 0:
                    start, found = position, c
                    break
        if start is None:
            raise TemplateMismatch(f"the chat template does not reproduce assistant message {index} verbatim")
        spans.append((start, start + len(found)))
        cursor = start + len(found)
    return text, spans


def special_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(token, "special", False))
    return ids


# ----------------------------------------------------------------------------------------------
# Special-token text inside messages


def _special_pattern(tokenizer) -> re.Pattern | None:
    """A regex of the texts the tokenizer turns into special ids (the ids of special_ids)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {})
    texts = {token.content for token in decoder.values() if getattr(token, "special", False)}
    texts.update(tokenizer.all_special_tokens)
    return _alternation(frozenset(t for t in texts if t))


@functools.lru_cache(maxsize=16)
def _alternation(texts: frozenset[str]) -> re.Pattern | None:
    """One regex of the texts, the longest first (a text that starts another must not win)."""
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=lambda t: (-len(t), t)))) if texts else None


def special_text_in(tokenizer, messages: list[dict]) -> tuple[int, str] | None:
    """(message index, the special token's text) of the first message whose text holds one."""
    pattern = _special_pattern(tokenizer)
    for index, message in enumerate(messages):
        for key in TEXT_KEYS:
            found = pattern.search(message.get(key) or "") if pattern else None
            if found:
                return index, found.group()
    return None


def screen_special_text(tokenizer, record_id: int, messages: list[dict], mode: str, stats) -> bool | None:
    """Whether the messages' text must be tokenized as plain text (it holds a special token's
    text and mode, data.special_text, is "encode"); None when the sample is refused for it
    (mode "refuse"): counted in stats under SPECIAL_TEXT_REASON, the first one with a warning."""
    found = special_text_in(tokenizer, messages)
    if found is None:
        return False
    if mode == "encode":
        return True
    if SPECIAL_TEXT_REASON not in stats.dropped_reasons:
        index, text = found
        log.warning("sample id %d: message %d (%s) holds %r, the text of a special token, which would become a control token "
                    "in the sample; such samples are refused and counted in stats.json (%s); data.special_text=encode keeps them, "
                    "that text tokenized as plain text", record_id, index, messages[index]["role"], text, SPECIAL_TEXT_REASON)
    stats.drop(SPECIAL_TEXT_REASON)
    return None


def _probed_render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
    """(the template's render, [(start, end)] of every message text in it), found by rendering a
    probe in place of each text; TemplateMismatch when the template does not insert the texts
    verbatim (the probes put back must give its render of the real messages)."""
    texts, probed = [], []
    for message in messages:
        copy = dict(message)
        for key in TEXT_KEYS:
            if message.get(key):
                copy[key] = _TEXT_PROBE.format(len(texts))
                texts.append(message[key])
        probed.append(copy)
    pieces = _TEXT_PROBES.split(render_chat(tokenizer, probed, add_generation_prompt))
    spans, position = [], 0
    for index in range(len(pieces)):
        if index % 2:  # a probe's number, between two pieces of template text
            pieces[index] = texts[int(pieces[index])]
            spans.append((position, position + len(pieces[index])))
        position += len(pieces[index])
    text = "".join(pieces)
    if text != render_chat(tokenizer, messages, add_generation_prompt):
        raise TemplateMismatch("the chat template does not insert the messages' text verbatim")
    return text, spans


def _text_spans(tokenizer, messages: list[dict]) -> list[tuple[int, int]]:
    """[(start, end)] of every message text in the text assistant_spans renders."""
    if not (messages and messages[-1]["role"] == "assistant" and messages[-1].get("reasoning_content")):
        return _probed_render(tokenizer, messages, False)[1]
    *head, last = messages  # rendered as served (_served_spans): <think>reasoning</think>content
    prompt, spans = _probed_render(tokenizer, head, True)
    opened = prompt.rstrip().endswith(THINK_OPEN)  # as served_answer: no <think> of the model's own then
    reasoning_start = len(prompt) + (0 if opened else len(THINK_OPEN))
    content_start = reasoning_start + len(last["reasoning_content"]) + len(THINK_CLOSE)
    return spans + [(reasoning_start, content_start - len(THINK_CLOSE)), (content_start, content_start + len(last["content"]))]


def _encode(tokenizer, text: str, plain_spans: list[tuple[int, int]]):
    """(input_ids, offsets) of `text`, the characters of plain_spans tokenized as plain text
    (split_special_tokens: a special token's text there gives its ordinary tokens), the rest as
    usual (the template's special tokens)."""
    cuts = [0, *(p for span in sorted(plain_spans) for p in span), len(text)]
    input_ids, offsets = [], []
    for index, (start, end) in enumerate(zip(cuts, cuts[1:])):
        if start == end:
            continue
        encoding = tokenizer(text[start:end], add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=index % 2 == 1)
        input_ids += encoding["input_ids"]
        offsets += [(a + start, b + start) for a, b in encoding["offset_mapping"]]
    return input_ids, offsets


def _plain_spans(tokenizer, text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The spans whose text holds a special token's text."""
    pattern = _special_pattern(tokenizer)
    return [(a, b) for a, b in spans if pattern and pattern.search(text, a, b)]


def prompt_ids(tokenizer, messages: list[dict], plain_text: bool = False) -> list[int]:
    """The ids of the prompt (the render with the generation prompt); plain_text: the messages'
    text holding special tokens' text is tokenized as plain text (screen_special_text)."""
    if not plain_text:
        return list(tokenizer(render_chat(tokenizer, messages, True), add_special_tokens=False)["input_ids"])
    text, spans = _probed_render(tokenizer, messages, True)
    return _encode(tokenizer, text, _plain_spans(tokenizer, text, spans))[0]


def tokenize_messages(tokenizer, messages: list[dict], plain_text: bool = False) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of the whole rendered conversation, no length limit.

    Masked: every token overlapping an assistant content span, plus the token right after it
    when that is a special token (the end of turn that closes the assistant message; the
    newline some templates add after it is not masked). The ids equal
    `apply_chat_template(messages, tokenize=True)`, except for a last assistant turn with
    reasoning (rendered as served: assistant_spans). plain_text: the messages' text that holds a
    special token's text is tokenized as plain text (screen_special_text, data.special_text=encode).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise UserInputError(f"{type(tokenizer).__name__}: the data stage needs a fast tokenizer (offsets)")
    text, spans = assistant_spans(tokenizer, messages)
    plain_spans = _plain_spans(tokenizer, text, _text_spans(tokenizer, messages)) if plain_text else []
    input_ids, offsets = _encode(tokenizer, text, plain_spans)
    starts = [start for start, _ in offsets]
    special = special_ids(tokenizer)
    loss_mask = [0] * len(input_ids)
    for span_start, span_end in spans:
        # tokens overlapping [span_start, span_end): begin before span_end, end after span_start
        first = bisect.bisect_left(starts, span_start)
        while first > 0 and offsets[first - 1][1] > span_start:
            first -= 1  # a token that begins before the span and reaches into it
        for t in range(first, len(input_ids)):
            token_start, token_end = offsets[t]
            if token_start >= span_end:
                break
            if token_end > span_start:
                loss_mask[t] = 1
        after = bisect.bisect_left(starts, span_end)
        while after < len(input_ids) and offsets[after][1] <= span_end:
            after += 1  # skip zero-width or straddling tokens already inside the span
        if after < len(input_ids) and input_ids[after] in special:
            loss_mask[after] = 1
    return input_ids, loss_mask


def fit_length(input_ids: list[int], loss_mask: list[int], max_length: int, overlong: str):
    """(input_ids, loss_mask, status) with status "ok" | "truncated" | "dropped" (None ids when dropped)."""
    if len(input_ids) <= max_length:
        return input_ids, loss_mask, "ok"
    if overlong == "drop":
        return None, None, "dropped"
    if overlong != "truncate":
        raise ValueError(f"data.overlong must be 'truncate' or 'drop', got {overlong!r}")
    return input_ids[:max_length], loss_mask[:max_length], "truncated"


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int, overlong: str = "truncate"):
    """(input_ids, loss_mask) of one chat conversation, or None when it is dropped.

    Dropped: longer than max_length with overlong="drop", or no assistant token left after
    truncation. Raises TemplateMismatch when the template rewrites an assistant message.
    """
    input_ids, loss_mask = tokenize_messages(tokenizer, messages)
    input_ids, loss_mask, _ = fit_length(input_ids, loss_mask, max_length, overlong)
    if input_ids is None or not any(loss_mask):
        return None
    return input_ids, loss_mask


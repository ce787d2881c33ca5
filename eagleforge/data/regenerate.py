"""Regeneration: the target answers the prompts itself (greedy, batched, resumable), as the
EAGLE-3 recipe asks: the draft then learns the target's own distribution. In-process, or from
an OpenAI-compatible server serving the target (data.server_url; the client is chat_client.py).

RUN/data/conversations.jsonl gets {"id", "messages", "new_tokens", "finished", "max_new_tokens"}
appended and fsynced one batch (in-process) or one answer (server) at a time, so a killed run
resumes where it stopped (ids already there are skipped). A thinking model's answer from a
server keeps its reasoning in the assistant message's `reasoning_content` (chat.py renders it).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from eagleforge.atomic import append_durably
from eagleforge.config import Config
from eagleforge.data.chat import THINK_OPEN, TemplateMismatch, prompt_ids, render_chat, screen_special_text, special_ids
from eagleforge.data.sources import Record, Stats, prompt_part
from eagleforge.errors import UserInputError

log = logging.getLogger(__name__)

CONVERSATIONS_FILE = "conversations.jsonl"
# Tokens that end an assistant turn in common chat templates; generation stops at any of them
# that the tokenizer knows as a special token, besides the model's own eos ids.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<|end|>", "<end_of_turn>", "</s>")


# ----------------------------------------------------------------------------------------------
# Regeneration (greedy, batched, resumable)


def _stop_ids(model, tokenizer) -> list[int]:
    """Token ids that end an answer: the model's eos ids, the tokenizer's eos, end-of-turn tokens."""
    ids = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    special = special_ids(tokenizer)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and vocab[t] in special)
    return sorted(ids)


def read_conversations(path: Path) -> dict[int, dict]:
    """Answered conversations by id; a torn last line (a killed writer) is cut off the file.

    Rows are appended whole with their newline, so only the tail after the last newline can
    be incomplete; a complete line that is not JSON means the file was damaged otherwise.
    """
    if not path.is_file():
        return {}
    raw = path.read_bytes()
    done, position, line_no = {}, 0, 0
    while position < len(raw):
        newline = raw.find(b"\n", position)
        line_no += 1
        if newline < 0:
            log.warning("%s: dropping a torn last line (%d bytes) left by an interrupted run", path, len(raw) - position)
            with open(path, "r+b") as f:
                f.truncate(position)
                f.flush()
                os.fsync(f.fileno())
            break
        line = raw[position:newline]
        if line.strip():
            try:
                row = json.loads(line.decode("utf-8"))
                done[int(row["id"])] = row
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError):
                raise UserInputError(f"{path} line {line_no}: not a conversation row; the file is damaged, delete it to regenerate") from None
        position = newline + 1
    return done


def _append_rows(path: Path, rows: list[dict]) -> None:
    """Append whole rows and make them durable before the next batch starts; a full disk is one
    line, the file cut back to the rows before (append_durably)."""
    append_durably(path, b"".join((json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8") for r in rows),
                   kept=f"the {len(rows)} answer{'s' * (len(rows) > 1)} of this write were not kept, those before were")


def _generate_batch(model, prompt_ids: list[list[int]], max_new_tokens: int, stop_ids: list[int], pad_id: int):
    """Greedy answers of a left-padded batch: [(answer ids without the stop token, stopped?)].

    Our own loop rather than `model.generate`: generate keeps computing rows that already
    stopped (a third of the answers stop early) and runs its logits processors every step.
    Here stopped rows leave the batch (their KV cache rows are dropped, a group at a time), the
    KV cache is preallocated (StaticCache: no per-step torch.cat of every layer's K and V), the
    CPU attention groups query heads per KV head (eagleforge.target.prepare_for_decoding), and one
    step costs one forward of the rows still in the batch plus one argmax and one host sync. Positions come from the attention
    mask (left padding), as in generate, so each row equals its own unbatched greedy decoding
    up to the numerics of batched matmuls.
    """
    import torch

    from eagleforge.target.loading import prepare_for_decoding

    prepare_for_decoding(model)
    if max_new_tokens < 1:
        raise ValueError(f"data.max_new_tokens must be >= 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    batch, width = len(prompt_ids), max(len(p) for p in prompt_ids)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((batch, width), dtype=torch.long)  # [B, T], 0 = left pad
    for row, ids in enumerate(prompt_ids):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention_mask[row, width - len(ids):] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]
    stop_set = set(stop_ids)
    cache = _new_cache(model, width + max_new_tokens)
    answers: list[list[int]] = [[] for _ in prompt_ids]
    finished = [False] * batch
    alive = list(range(batch))  # original row of each row still in the batch
    with torch.inference_mode():
        logits = _forward(model, input_ids, attention_mask, position_ids, cache, logits_to_keep=1)  # [B, 1, V]
        next_pos = position_ids[:, -1:] + 1  # [B, 1]
        for step in range(max_new_tokens):
            tokens = logits[:, -1].argmax(dim=-1)  # [b]
            for row, token in zip(alive, tokens.tolist()):  # one host sync per step
                if finished[row]:
                    continue  # stopped earlier, still in the batch until the next drop
                if token in stop_set:
                    finished[row] = True
                else:
                    answers[row].append(token)
            if step == max_new_tokens - 1:
                break
            done = [finished[row] for row in alive]
            # Drop stopped rows once they are an eighth of the batch: each drop copies the
            # whole cache (GBs at batch 512 on a GPU), so it is batched rather than per row.
            if sum(done) >= max(1, len(alive) // 8):
                keep_rows = [i for i, is_done in enumerate(done) if not is_done]
                if not keep_rows:
                    break
                keep = torch.tensor(keep_rows, dtype=torch.long, device=device)  # [b']
                alive = [alive[i] for i in keep_rows]
                _select_rows(cache, keep)
                tokens, attention_mask, next_pos = tokens[keep], attention_mask[keep], next_pos[keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(alive), 1)], dim=1)  # [b, T+1]
            logits = _forward(model, tokens[:, None], attention_mask, next_pos, cache)  # [b, 1, V]
            next_pos = next_pos + 1
    return list(zip(answers, finished))


def _generate_fitting(model, prompt_ids: list[list[int]], max_new_tokens: int, stop_ids: list[int], pad_id: int):
    """_generate_batch, halving the batch on an accelerator out-of-memory error (the longest
    prompts come last and need the most KV cache); the answers are the same up to the numerics
    of batched matmuls (as between any two batch sizes)."""
    import torch

    try:
        return _generate_batch(model, prompt_ids, max_new_tokens, stop_ids, pad_id)
    except torch.OutOfMemoryError:
        if len(prompt_ids) == 1:
            raise
    torch.cuda.empty_cache()  # outside the except block: the error's frames no longer hold the cache
    half = len(prompt_ids) // 2
    log.warning("out of memory generating %d rows: retrying as %d + %d (lower data.gen_batch_size to avoid this)",
                len(prompt_ids), half, len(prompt_ids) - half)
    return (_generate_fitting(model, prompt_ids[:half], max_new_tokens, stop_ids, pad_id)
            + _generate_fitting(model, prompt_ids[half:], max_new_tokens, stop_ids, pad_id))


def _new_cache(model, max_len: int):
    """A preallocated KV cache: a DynamicCache re-copies every layer's K and V on each step
    (torch.cat), a large share of a bf16 CPU decode step (measured: BENCHMARKS.md, "Smaller
    measurements the code's choices rest on")."""
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=max_len)


def _select_rows(cache, keep) -> None:
    """Keep only batch rows `keep` [b'] of a StaticCache (StaticLayer has no batch_select_indices)."""
    for layer in cache.layers:
        if layer.is_initialized:
            layer.keys, layer.values = layer.keys[keep], layer.values[keep]
            layer.batch_size = layer.keys.shape[0]


def _forward(model, input_ids, attention_mask, position_ids, cache, logits_to_keep: int = 0):
    """One cached forward; transformers >= 5.2x names the cache argument `cache`."""
    import inspect

    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    kwargs = {key: cache, "use_cache": True}
    if logits_to_keep:
        kwargs["logits_to_keep"] = logits_to_keep  # the prefill needs only the last row of [T, V]
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs).logits


def _prompts(tokenizer, records: list[Record], data, stats: Stats) -> dict[int, tuple[list[dict], list[int]]]:
    """{id: (prompt messages, prompt token ids)}; prompts of data.max_length tokens or more are
    dropped, and those whose text holds a special token's text are refused or encoded as plain
    text (data.special_text), before anything is generated for them."""
    prompts = {}
    for record in records:
        messages = prompt_part(record.messages)
        plain_text = screen_special_text(tokenizer, record.id, messages, data.special_text, stats)
        if plain_text is None:
            continue  # refused, counted
        try:
            ids = prompt_ids(tokenizer, messages, plain_text)
        except TemplateMismatch:
            stats.drop("template_rewrites_assistant_text")
            continue
        if len(ids) >= data.max_length:
            stats.drop("prompt_longer_than_max_length")
            continue
        prompts[record.id] = (messages, list(ids))
    return prompts


def _row(record_id: int, prompt: list[dict], answer: dict, new_tokens: int, finished: bool, max_new_tokens: int) -> dict:
    return {"id": record_id, "messages": prompt + [answer], "new_tokens": new_tokens, "finished": finished,
            "max_new_tokens": max_new_tokens}


def regenerate(cfg: Config, records: list[Record], data_dir: Path, stats: Stats, tokenizer=None) -> dict[int, list[dict]]:
    """Answer each record's prompt with the target (greedy); {id: conversation messages}.

    In-process, or from the server at data.server_url when set (then only the tokenizer is
    loaded here: `tokenizer`, else the target's). Ids already in conversations.jsonl are skipped,
    so a killed run resumes where it stopped.
    """
    from eagleforge.target.loading import load_tokenizer

    path = data_dir / CONVERSATIONS_FILE
    done = read_conversations(path)
    data = cfg.data
    model = None
    if not data.server_url:
        from eagleforge.target.loading import load_target

        model, tokenizer = load_target(cfg.target)
    elif tokenizer is None:
        tokenizer = load_tokenizer(cfg.target)
    prompts = _prompts(tokenizer, records, data, stats)
    for record_id, row in done.items():
        if record_id in prompts and (row["messages"][:-1] != prompts[record_id][0] or row.get("max_new_tokens") != data.max_new_tokens):
            raise UserInputError(
                f"{path}: id {record_id} was answered for another prompt or max_new_tokens (the config changed?); "
                "delete the file or use another run_dir"
            )
    if data.server_url:
        _answer_by_server(cfg, prompts, done, path, stats, tokenizer)
    else:
        _answer_in_process(cfg, model, tokenizer, prompts, done, path, stats)
    return {i: done[i]["messages"] for i in prompts if i in done}  # a prompt the server refused is left out


def _answer_in_process(cfg: Config, model, tokenizer, prompts: dict, done: dict, path: Path, stats: Stats) -> None:
    """Batches are formed from all prompts sorted by token length (less padding), so a resumed
    run forms the same batches and skips those already in conversations.jsonl."""
    from tqdm import tqdm

    from eagleforge.target.loading import padding_id

    data = cfg.data
    order = sorted(prompts, key=lambda i: (len(prompts[i][1]), i))
    batches = [order[i:i + data.gen_batch_size] for i in range(0, len(order), data.gen_batch_size)]
    todo = [[i for i in batch if i not in done] for batch in batches]
    todo = [batch for batch in todo if batch]
    pending = sum(len(b) for b in todo)
    log.info("regeneration: %d prompts, %d already answered in %s, %d to go", len(prompts), len(prompts) - pending, path, pending)

    stop_ids = _stop_ids(model, tokenizer)
    pad = padding_id(tokenizer)
    new_tokens, seconds = 0, 0.0
    with tqdm(total=pending, unit="prompt", desc="generate", dynamic_ncols=True) as bar:
        for batch in todo:
            start = time.perf_counter()
            answers = _generate_fitting(model, [prompts[i][1] for i in batch], data.max_new_tokens, stop_ids, pad)
            seconds += time.perf_counter() - start
            rows = []
            for record_id, (answer_ids, finished) in zip(batch, answers):
                text = tokenizer.decode(answer_ids, skip_special_tokens=True)
                count = len(answer_ids) + int(finished)  # the stop token is generated too
                new_tokens += count
                rows.append(_row(record_id, prompts[record_id][0], {"role": "assistant", "content": text}, count, finished, data.max_new_tokens))
            _append_rows(path, rows)
            done.update((row["id"], row) for row in rows)
            bar.update(len(batch))
            bar.set_postfix(new_tok_s=f"{new_tokens / max(seconds, 1e-9):.1f}")
    stats.generation = {
        "prompts_answered_now": pending,
        "prompts_answered_before": len(prompts) - pending,
        "new_tokens": new_tokens,
        "seconds": round(seconds, 2),
        "new_tokens_per_s": round(new_tokens / seconds, 2) if seconds else None,
        "batch_size": data.gen_batch_size,
        "max_new_tokens": data.max_new_tokens,
        "torch_threads": _torch_threads(),
    }
    log.info("generated %d new tokens in %.1f s (%.1f new tokens/s)", new_tokens, seconds, new_tokens / max(seconds, 1e-9))


def _answer_by_server(cfg: Config, prompts: dict, done: dict, path: Path, stats: Stats, tokenizer) -> None:
    """data.concurrency requests in flight; each answer is appended (fsynced) as it arrives, in
    whatever order they complete: the ids make a resumed run skip exactly those written."""
    from tqdm import tqdm

    from eagleforge.data import chat_client

    data = cfg.data
    base = chat_client.base_url(data.server_url)
    url = base + "/chat/completions"
    todo = [i for i in sorted(prompts) if i not in done]
    # a finished run's rerun needs no server
    model = chat_client.served_model(base, data.server_model, data.request_timeout_s, data.max_retries) if todo else data.server_model
    log.info("regeneration by %s (model %s, %d in flight): %d prompts, %d already answered in %s, %d to go",
             url, model, data.concurrency, len(prompts), len(prompts) - len(todo), path, len(todo))

    def ask(record_id):
        messages = prompts[record_id][0]
        opened = render_chat(tokenizer, messages, True).rstrip().endswith(THINK_OPEN)  # the template opens <think>
        try:
            return chat_client.chat(url, model, messages, data.max_new_tokens, data.request_timeout_s, data.max_retries, opened)
        except chat_client.Dropped as dropped:
            return dropped  # this prompt only: dropped and counted below

    new_tokens = answered = retries = 0
    start = time.perf_counter()
    with tqdm(total=len(todo), unit="prompt", desc="generate", dynamic_ncols=True) as bar:
        for record_id, answer in chat_client.completed(todo, ask, data.concurrency):
            bar.update(1)
            if isinstance(answer, chat_client.Dropped):
                if answer.reason not in stats.dropped_reasons:
                    log.warning("%s %s prompt id %d: %s (such prompts are dropped and counted in stats.json)",
                                url, answer.verb, record_id, answer)
                stats.drop(answer.reason)
                continue
            finished = answer.finish_reason == "stop"
            count = answer.completion_tokens
            if count is None:  # a server that sends no usage: count the answer's tokens here
                count = len(tokenizer(answer.reasoning + answer.content, add_special_tokens=False)["input_ids"]) + int(finished)
            message = {"role": "assistant", "content": answer.content}
            if answer.reasoning:
                message["reasoning_content"] = answer.reasoning
            row = _row(record_id, prompts[record_id][0], message, count, finished, data.max_new_tokens)
            _append_rows(path, [row])
            done[record_id] = row
            new_tokens += count
            answered += 1
            retries += answer.attempts - 1
            bar.set_postfix(new_tok_s=f"{new_tokens / max(time.perf_counter() - start, 1e-9):.1f}")
    seconds = time.perf_counter() - start
    stats.generation = {
        "server_url": url,
        "server_model": model,
        "prompts_answered_now": answered,
        "prompts_answered_before": len(prompts) - len(todo),
        "prompts_refused": stats.dropped_reasons.get(chat_client.Rejected.reason, 0),
        "replies_malformed": stats.dropped_reasons.get(chat_client.Malformed.reason, 0),
        "new_tokens": new_tokens,
        "seconds": round(seconds, 2),
        "new_tokens_per_s": round(new_tokens / seconds, 2) if seconds else None,
        "concurrency": data.concurrency,
        "retries": retries,
        "max_new_tokens": data.max_new_tokens,
    }
    log.info("%s: %d answers, %d new tokens in %.1f s (%.1f new tokens/s), %d retries",
             url, answered, new_tokens, seconds, new_tokens / max(seconds, 1e-9), retries)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()

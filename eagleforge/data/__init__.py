"""The data stage: prompts -> conversations (optionally answered by the target) -> token rows.

    sources.py      input rows (files, hub datasets, stdlib prompts) -> validated Records
    chat.py         a conversation -> input_ids and the assistant loss mask
    regenerate.py   the target answers the prompts (greedy, batched, resumable)
    prompts.py      the built-in prompts from the standard library's docstrings
    stage.py        the stage itself: RUN/data/samples.jsonl and stats.json
"""

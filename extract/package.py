"""Hidden-state extraction: the target's forward with capture hooks, written to RUN/hidden/.

    __main__.py   the stage: `python -m eagleforge.extract`
    driver.py     one chunk/resume/writer loop for both backends (and online training's target)
    target.py     the Target protocol both backends implement
    hf.py         target.backend=hf: any transformers causal LM
    native/       target.backend=native: DeepSeek-V3 / Kimi-K2.5, tensor and pipeline parallel
    capture.py    the forward hooks that capture the aux layers' outputs
    samples.py    RUN/data's token rows in length-sorted chunks
    writer.py     the shard writer (a thread; atomic shards, manifest last)
"""

"""The target: the large model whose hidden states the draft learns from, as every stage sees it.

    loading.py    the transformers target: path, tokenizer, model (the embedded SmolLM2 from its
                  GGUF, device maps), its layers and norms, the default aux layers
    capture.py    the forward hooks that capture the aux layers' outputs and the final state
    protocol.py   Target: token rows in, captured rows out (`open_target` picks the backend), the
                  packing of rows and their travel between ranks
    hf.py         the hf backend: any transformers causal LM as a Target, one rank per group
    groups.py     how the target's ranks form groups (tp x pp) and target.layout=auto's choice

The native backend (DeepSeek-V3 / Kimi-K2.5, tensor and pipeline parallel) is extract/native/:
its model math, parallel layers and checkpoint loader, and its Target (extract/native/target.py),
which `open_target` loads for target.backend=native. The extract stage (extract/driver.py), online
training (train/online.py), the data stage's regeneration and eval all take the target from here.
"""

"""Training of the EAGLE-3 draft: the TTT loop (loop.py), batches of whole samples from the
shards (batching.py), the soft cross-entropy reference (loss.py), resumable checkpoints
(checkpoint.py). Entry point: `python -m eagleforge.train` (see __main__.py)."""

"""Evaluation: real chain speculative decoding of a trained draft against its target (greedy
verification, output equal to plain greedy decoding), prompt lookup as the baseline, and the
acceptance figures and plots written to RUN/eval/ (docs/eval-results.md).

    specdec.py    the decoding loops (draft proposes k tokens, target verifies) and n-gram lookup
    evaluate.py   the stage: prompts, runs, results.json
    plots.py      PNG plots beside results.json
"""

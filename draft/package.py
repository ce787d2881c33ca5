"""EAGLE-3 draft library: model, config and the vLLM/SGLang export format.

Standalone: no dependency on the stages or the target, only on the root package's plain helpers
(eagleforge.modes, .atomic, .errors, .readers), and no torch.distributed, so serving-side users
can `from eagleforge import draft` alone.
"""

from eagleforge.draft.attention import ttt_attention, ttt_attention_reference, ttt_attention_sdpa
from eagleforge.draft.config import Eagle3Config
from eagleforge.draft.io import EXPORT_TENSOR_NAMES, expected_tensors, export_tensor_specs, load_draft, save_draft
from eagleforge.draft.model import DraftCache, Eagle3Draft

__all__ = [
    "DraftCache", "EXPORT_TENSOR_NAMES", "Eagle3Config", "Eagle3Draft", "expected_tensors", "export_tensor_specs",
    "load_draft", "save_draft", "ttt_attention", "ttt_attention_reference", "ttt_attention_sdpa",
]

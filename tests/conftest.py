"""Shared fixtures. Tests run on a 2-core CPU: keep models tiny unless a test needs SmolLM2."""

import os
import zlib

import pytest
import torch

# OMP_NUM_THREADS wins when set (on a busy machine 1 thread is much faster than 2).
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or max(1, min(2, os.cpu_count() or 1))))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; the CPU path of the same logic is tested elsewhere")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, float32, CPU."""
    from eagleforge.config import TargetConfig
    from eagleforge.target.loading import load_target

    return load_target(TargetConfig(device="cpu", dtype="float32"))


@pytest.fixture
def tiny_llama_config():
    """A tiny random Llama config with odd sizes (hidden 48, 3 heads, 7 layers, vocab 211)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=211, hidden_size=48, intermediate_size=80, num_hidden_layers=7,
        num_attention_heads=3, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0, eos_token_id=2, bos_token_id=1,
    )


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module of tiny models: faster than two, and much faster on a
    busy machine. Use with pytestmark = pytest.mark.usefixtures("one_torch_thread")."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def compiled():
    """Skip (with the reason) where torch.compile's backend cannot build, e.g. no C++ compiler
    on a CPU machine; otherwise start from a fresh dynamo state (graph counters at zero)."""
    try:
        torch.compile(lambda x: torch.nn.functional.silu(x) * 2, fullgraph=True, dynamic=False)(torch.randn(3))
    except Exception as err:  # noqa: BLE001 - any failure means: skip with the reason
        pytest.skip(f"torch.compile does not work on this machine: {err!r}"[:300])
    torch._dynamo.reset()


@pytest.fixture
def test_seed(request) -> int:
    """The seed of a test's random draws: from its name (each test its own, the same on every run
    and in any order of the tests), or EAGLEFORGE_TEST_SEED to repeat a draw. Printed, so a failing
    test's captured output says which seed it ran with."""
    seed = int(os.environ.get("EAGLEFORGE_TEST_SEED") or zlib.crc32(request.node.name.encode()))
    print(f"random seed {seed} (EAGLEFORGE_TEST_SEED={seed} repeats this test's draws)")
    return seed

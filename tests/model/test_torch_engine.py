"""The torch engine's parts: optional import, device strings, the KV cache in
blocks under the budget, weights mapped or converted, and the host <-> device
transfer seam (the CUDA path's pinned staging, driven on the CPU with
ordinary memory).

Tests that take ``device`` run on the CPU and, where a GPU is, on CUDA
(``.ci/gpu-check.sh`` runs them on one); without CUDA the ``cuda`` case is
skipped with its reason, so CI on a CPU machine still passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from meshnet_model import KVBudgetExceeded, SessionEnded, StageRunner
from meshnet_model.engines.torch import TorchUnavailable, load_torch_runner, parse_device
from meshnet_model.engines.torch._torch import check_device, import_torch
from meshnet_model.engines.torch.kv_cache import BLOCK, TorchKVCache
from meshnet_model.engines.torch.transfer import Staging, Transfer
from meshnet_model.stage.kv_cache import KVBudget
from meshnet_model.testing import small_config, write_checkpoint
from meshnet_model.testing.random_gguf import TINY, TINY_WEIGHT_STD, write_random_gguf
from meshnet_node.__main__ import main as node_main
from meshnet_node.config import NodeConfig
from support.gateway import clean_env
from support.reference import logit_error
from support.torch import CUDA, DEVICES, greedy

VOCAB, LAYERS = 256, 4
PROMPT = [(11 * i + 5) % VOCAB for i in range(13)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("f32"), small_config(), seed=3)


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("bf16"), small_config(), seed=3,
                            dtype="bfloat16")  # fmt: skip


# -- torch stays optional ------------------------------------------------------------------


def test_the_numpy_path_never_imports_torch() -> None:
    code = (
        "import sys, meshnet_model, meshnet_node.model_stage, meshnet_node.__main__, "
        "meshnet_model.engines.torch\n"
        "assert 'torch' not in sys.modules, 'torch imported'\nprint('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_missing_torch_is_one_line_naming_the_extra(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # "import torch" now raises ImportError
    with pytest.raises(TorchUnavailable, match=r"pip install -e '\.\[torch\]' in the meshnet"):
        import_torch()
    assert node_main(["--model", str(checkpoint), "--engine", "torch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install -e '.[torch]'" in err[0], err


# -- devices -------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["cpu", "cuda", "cuda:0", "cuda:7", "cuda:123"])
def test_device_strings_accepted(text: str) -> None:
    assert parse_device(text) == text
    assert NodeConfig.load(["--model", "m", "--engine", "torch", "--device", text]).device == text


@pytest.mark.parametrize("text", ["gpu", "CUDA", "cuda:", "cuda:01", "cuda:-1", "cuda:1000", "mps"])
def test_device_strings_refused(text: str) -> None:
    with pytest.raises(ValueError, match="cpu, cuda or cuda:N"):
        parse_device(text)
    with pytest.raises(SystemExit) as exited:
        NodeConfig.load(["--model", "m", "--engine", "torch", "--device", text])
    assert exited.value.code == 2


def test_engine_flags_need_torch_and_a_model() -> None:
    for argv in (["--model", "m", "--engine", "numpy", "--device", "cuda"], ["--engine", "torch"]):
        with pytest.raises(SystemExit) as exited:
            NodeConfig.load(argv)
        assert exited.value.code == 2
    config = NodeConfig.load(["--model", "m", "--engine", "torch", "--threads", "2"])
    assert (config.engine, config.device, config.threads) == ("torch", "cpu", 2)
    # Left to itself the engine is chosen at load (engines.choice): a CUDA
    # device can only be torch's.
    assert NodeConfig.load(["--model", "m", "--device", "cuda"]).engine == "auto"


def test_cuda_without_cuda_is_exit_2_in_one_line(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA device"):
        check_device(torch, "cuda:0")
    assert node_main(["--model", str(checkpoint), "--engine", "torch", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cuda: no CUDA device is available" in err[0], err


def test_a_cuda_index_past_the_devices_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device(torch, "cuda:1")
    with pytest.raises(ValueError, match="has 2 CUDA device"):
        check_device(torch, "cuda:2")


# -- weights -------------------------------------------------------------------------------


def test_weights_in_the_checkpoint_dtype_are_the_map_itself(
    checkpoint: Path, bf16_checkpoint: Path
) -> None:
    f32 = load_torch_runner(checkpoint, dtype="float32")
    bf16 = load_torch_runner(bf16_checkpoint, dtype="keep")
    converted = load_torch_runner(checkpoint, dtype="bfloat16")
    q_bytes = 64 * 64
    # bf16 kept as bf16: half of float32's bytes, never widened, matrices shared with the map.
    assert bf16.describe()["compute_dtype"] == "bfloat16"
    assert bf16.model.weights.blocks[0].q.dtype == torch.bfloat16
    assert bf16.describe()["weights_bytes"] * 2 == f32.describe()["weights_bytes"]
    assert bf16.model.weights.shared_with_file >= LAYERS * q_bytes * 2
    assert f32.model.weights.shared_with_file >= LAYERS * q_bytes * 4
    # Converted: its own tensors, nothing shared with the file's matrices.
    assert converted.describe()["weights_bytes"] == bf16.describe()["weights_bytes"]
    assert converted.model.weights.shared_with_file == 0
    # The runner keeps the stage's shape, not a second copy of the arrays.
    assert converted.weights.blocks == [] and converted.weights.embed is None
    ids, _ = greedy([converted], PROMPT, 4)
    assert greedy([bf16], PROMPT, 4)[0] == ids  # the same bf16 numbers either way


# -- the KV cache --------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_kv_cache_grows_in_blocks_and_refuses_past_the_budget(
    checkpoint: Path, device: str
) -> None:
    per_position = 2 * LAYERS * 2 * 16 * 2  # K and V, 4 layers, 2 KV heads, head_dim 16, bf16
    runner = load_torch_runner(
        checkpoint, dtype="bfloat16", device=device, kv_budget_bytes=2 * BLOCK * per_position
    )
    ids = np.asarray([PROMPT], np.int32)
    runner.run("a", 0, ids)
    assert runner.kv_bytes_in_use == BLOCK * per_position  # one block, in bf16
    cache = runner._lives["a"].cache
    assert cache.keys[0].dtype == torch.bfloat16 and cache.capacity == BLOCK
    assert cache.keys[0].device.type == device
    runner.run("b", 0, ids)
    assert runner.kv_bytes_in_use == 2 * BLOCK * per_position
    with pytest.raises(KVBudgetExceeded):
        runner.run("c", 0, ids)
    # A chunk that would need a second block for "a" does not fit either; nothing grew.
    with pytest.raises(KVBudgetExceeded):
        runner.run("a", len(PROMPT), np.zeros((1, BLOCK), np.int32))
    assert runner.kv_bytes_in_use == 2 * BLOCK * per_position
    assert runner.end_session("b") == BLOCK * per_position
    assert runner.end_session("b") == 0
    runner.run("c", 0, ids)
    assert runner.sessions == 2


@pytest.mark.parametrize("device", DEVICES)
def test_retransmission_recomputes_the_same_bits_and_ended_sessions_refuse(
    checkpoint: Path, device: str
) -> None:
    runner = load_torch_runner(checkpoint, dtype="float32", device=device)
    ids = np.asarray([PROMPT], np.int32)
    runner.run("s", 0, ids[:, :8])
    first = runner.run("s", 8, ids[:, 8:]).copy()
    again = runner.run("s", 8, ids[:, 8:])  # the cache held 13: truncated back to 8
    assert np.array_equal(first, again)
    cache = runner._lives["s"].cache
    runner.end_session("s")
    with pytest.raises(SessionEnded):
        cache.reserve(cache.capacity + 1)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_and_numpy_runners_agree(checkpoint: Path, device: str) -> None:
    split = [load_torch_runner(checkpoint, span, device=device)
             for span in (range(0, 2), range(2, 4))]  # fmt: skip
    assert split[0].describe()["device"] == device
    torch_ids, torch_logits = greedy(split, PROMPT, 8)
    numpy_ids, numpy_logits = greedy([StageRunner.load(checkpoint)], PROMPT, 8)
    assert torch_ids == numpy_ids
    scale = max(1.0, float(np.abs(numpy_logits).max()))
    assert float(np.abs(torch_logits - numpy_logits).max()) / scale <= 1e-5


def test_attention_takes_the_output_layout_of_cudas_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CUDA's memory-efficient attention (float32 with a mask) returns its output
    as a transposed view, ``[b, heads, L, d]`` over ``[b, L, heads, d]`` memory.
    Regrouping the folded query axis (``groups * rows``) into heads must copy
    then: a ``view`` raised on an H200 for every such chunk (.ci/gpu-check.sh).
    Here the CPU kernel's output is handed back in that layout."""
    from meshnet_model.engines.torch.layers import attend

    config = small_config()  # 4 heads over 2 KV heads: groups of 2
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    gen = torch.Generator().manual_seed(0)
    rows, past = 7, 3
    q = torch.randn(rows, heads, d, generator=gen)
    k, v = (torch.randn(rows, kv_heads, d, generator=gen) for _ in range(2))
    cache = torch.randn(2, 1, kv_heads, BLOCK, d, generator=gen)

    def run() -> torch.Tensor:
        keys, values = cache.clone()
        return attend(torch, q, k, v, config, keys, values, past, None, batch=1)

    want = run()
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def cuda_layout(*args: object, **kwargs: object) -> torch.Tensor:
        out = sdpa(*args, **kwargs)  # type: ignore[arg-type]
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, its strides

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", cuda_layout)
    assert torch.equal(run(), want)


def test_a_cuda_stage_takes_cudnn_out_of_attention() -> None:
    """cuDNN's attention plans each new key length (82 ms a decode step against
    23 ms on an H200, layers.avoid_planned_attention): a CUDA stage turns it
    off, a CPU stage leaves torch's choice as it was."""
    from meshnet_model.engines.torch.layers import avoid_planned_attention

    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        avoid_planned_attention(torch, torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        avoid_planned_attention(torch, torch.device("cuda:1"))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


# -- host <-> device -----------------------------------------------------------------------


def test_cpu_transfer_is_a_view_both_ways() -> None:
    transfer = Transfer(torch, torch.device("cpu"))
    assert transfer.new_staging() is None
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    tensor = transfer.to_device(array, torch.float32)
    assert tensor.data_ptr() == array.__array_interface__["data"][0]
    out = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    host = transfer.to_host(out, None)
    assert host.dtype == np.dtype(ml_dtypes.bfloat16) and host.shape == (2, 3)
    assert host.__array_interface__["data"][0] == out.data_ptr()
    assert host.astype(np.float32).tolist() == [[0, 1, 2], [3, 4, 5]]


class RecordingHost:
    """Stands in for pinned allocation: ordinary memory, every buffer counted."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    def __call__(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.empty(numel, dtype=dtype)
        self.buffers.append(buffer)
        return buffer


def test_staging_reuses_one_buffer_while_no_answer_is_held() -> None:
    alloc = RecordingHost()
    staging = Staging(torch, alloc)
    for step in range(10):
        out = staging.copy_out(torch.full((1, 1, 8), float(step), dtype=torch.bfloat16))
        assert out.dtype == np.dtype(ml_dtypes.bfloat16)
        assert out.astype(np.float32).ravel().tolist() == [float(step)] * 8
        del out  # the node dropped the answer: the buffer is free again
    assert (len(alloc.buffers), staging.copies) == (1, 10)
    # A longer chunk than the buffer holds: a new, larger buffer.
    big = staging.copy_out(torch.ones(3, 8))
    assert len(alloc.buffers) == 2 and big.shape == (3, 8)
    del big
    # Two kept, both free: a third size replaces one instead of growing the pool.
    staging.copy_out(torch.ones(5, 8))
    assert len(alloc.buffers) == 3 and len(staging.pool) == 2


def test_staging_never_overwrites_an_answer_the_node_still_holds() -> None:
    alloc = RecordingHost()
    staging = Staging(torch, alloc)
    kept = staging.copy_out(torch.full((4,), 1.0))
    body = memoryview(kept[1:])  # what a stored reply or a socket write holds
    del kept
    later = staging.copy_out(torch.full((4,), 2.0))
    assert len(alloc.buffers) == 2  # the first buffer was still lent
    third = staging.copy_out(torch.full((4,), 3.0))
    assert len(alloc.buffers) == 3 and len(staging.pool) == 2  # its own buffer, not kept
    assert np.frombuffer(body, np.float32).tolist() == [1.0, 1.0, 1.0]
    assert later.tolist() == [2.0] * 4 and third.tolist() == [3.0] * 4


def test_a_staged_engine_decodes_exactly_like_the_view_path(checkpoint: Path) -> None:
    alloc = RecordingHost()
    staged = Transfer(torch, torch.device("cpu"), staged=True, alloc=alloc)
    runners = [
        load_torch_runner(checkpoint, span, dtype="bfloat16", transfer=staged)
        for span in (range(0, 2), range(2, 4))
    ]
    plain = [
        load_torch_runner(checkpoint, span, dtype="bfloat16") for span in (range(0, 2), range(2, 4))
    ]
    ids, logits = greedy(runners, PROMPT, 12)
    want_ids, want_logits = greedy(plain, PROMPT, 12)
    assert ids == want_ids and np.array_equal(logits, want_logits)
    stagings = [r._lives["s"].cache.staging for r in runners]
    # 3 prefill chunks + 12 decode steps per stage, each one device->host copy.
    assert [s.copies for s in stagings] == [15, 15]
    # The hidden states are dropped once the next stage ran: one buffer. The
    # logits of step k are still held while step k+1 copies: two, alternating.
    assert [s.allocations for s in stagings] == [1, 2]


@CUDA
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_cuda_stage_hands_out_host_arrays_from_pinned_buffers(
    checkpoint: Path, dtype: str
) -> None:
    spans = (range(0, 2), range(2, 4))
    runners = [load_torch_runner(checkpoint, span, dtype=dtype, device="cuda") for span in spans]
    assert not torch.backends.cuda.cudnn_sdp_enabled()  # layers.avoid_planned_attention
    ids, logits = greedy(runners, PROMPT, 12)
    hidden = runners[0].run("h", 0, np.asarray([PROMPT], np.int32))
    assert isinstance(hidden, np.ndarray) and hidden.dtype.name == dtype
    stagings = [r._lives["s"].cache.staging for r in runners]
    # As the recording allocator counts them on the CPU (the staged test above).
    assert [s.copies for s in stagings] == [15, 15]
    assert [s.allocations for s in stagings] == [1, 2]
    assert all(buffer.is_pinned() for s in stagings for buffer, _ in s.pool)
    want_ids, want = greedy([load_torch_runner(checkpoint, span) for span in spans], PROMPT, 12)
    if dtype == "float32":
        assert ids == want_ids and logit_error(logits, want) <= 1e-5
    else:  # the prompt's logits (the same context): bfloat16's budget (test_torch_reference)
        assert logit_error(logits[:1], want[:1]) <= 2e-2


@CUDA
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_session_moves_between_cuda_and_cpu_stages_bit_for_bit(
    checkpoint: Path, dtype: str
) -> None:
    """The KV hand-off (stage.handoff) out of a CUDA stage: its state is the
    host copy of the device's numbers, which a CUDA or a CPU stage takes."""
    from meshnet_model.stage.handoff import export_kv, import_kv

    ids = np.asarray([PROMPT], np.int32)
    source = load_torch_runner(checkpoint, dtype=dtype, device="cuda")
    source.run("s", 0, ids)
    state = export_kv(source, "s")
    assert state is not None and state.dtype.name == dtype and state.shape[4] == len(PROMPT)
    step = np.asarray([[PROMPT[0]]], np.int32)
    want = source.run("s", len(PROMPT), step).copy()
    for device in ("cuda", "cpu"):
        target = load_torch_runner(checkpoint, dtype=dtype, device=device)
        import_kv(target, "s", state)
        cache = target._lives["s"].cache
        assert cache.keys[0].device.type == device
        assert cache.export_state().tobytes() == state.tobytes()
        got = target.run("s", len(PROMPT), step)
        if device == "cuda":
            assert np.array_equal(got, want)
        else:
            assert logit_error(got, want) <= (1e-5 if dtype == "float32" else 2e-2)
    # And back: a CPU stage's state continues on the GPU.
    cpu = load_torch_runner(checkpoint, dtype=dtype)
    cpu.run("c", 0, ids)
    back = TorchKVCache(torch, KVBudget(1 << 30), layers=LAYERS, batch=1, kv_heads=2,
                        head_dim=16, dtype=getattr(torch, dtype),
                        device=torch.device("cuda"))  # fmt: skip
    back.import_state(cpu._lives["c"].cache.export_state())
    assert back.export_state().tobytes() == cpu._lives["c"].cache.export_state().tobytes()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf", TINY, "Q4_1",
                             seed=5, weight_std=TINY_WEIGHT_STD)  # fmt: skip


@CUDA
def test_a_gguf_file_on_cuda_dequantized_and_kept_against_the_cpu(tiny_gguf: Path) -> None:
    """A quantized file's two stages on CUDA: ``--dtype float32`` gives the CPU's
    float32 tokens and logits; ``keep`` holds every matrix dequantized to
    bfloat16 on the device (no int4pack kernel there), the embedding mapped,
    and stays within the quantized path's error budget (test_quantized_budget)."""
    from meshnet_model.testing.quality import compare

    layers = TINY["num_hidden_layers"]
    spans = (range(0, 1), range(1, layers))
    prompt = [(13 * i + 7) % TINY["vocab_size"] for i in range(11)]

    def stages(device: str, dtype: str) -> list[StageRunner]:
        return [load_torch_runner(tiny_gguf, span, dtype=dtype, device=device) for span in spans]

    want_ids, want = greedy(stages("cpu", "float32"), prompt, 16)
    ids, logits = greedy(stages("cuda", "float32"), prompt, 16)
    assert ids == want_ids and logit_error(logits, want) <= 1e-5
    kept = stages("cuda", "keep")
    assert kept[0].describe()["weights_held"] == {"bfloat16": 7, "mapped(Q4_1)": 1}
    assert kept[1].describe()["weights_held"] == {"bfloat16": 8}
    assert kept[1].describe()["compute_dtype"] == "float32"
    _, kept_logits = greedy(kept, prompt, 16)
    assert logit_error(kept_logits[:1], want[:1]) <= 2e-2
    sequence = np.asarray([(prompt + want_ids) * 4], np.int32)
    whole = load_torch_runner(tiny_gguf, dtype="keep", device="cuda")
    agreement = compare(load_torch_runner(tiny_gguf, dtype="float32").model, whole.model,
                        sequence)  # fmt: skip
    assert agreement.kl_mean <= 0.005 and agreement.top1 >= 0.9, agreement


def test_meshnet_run_hands_the_engine_flags_to_its_nodes(checkpoint: Path) -> None:
    # cuda:999 exists nowhere: the nodes refuse it (no CUDA here, or too few
    # devices), which shows the flags reached them.
    result = subprocess.run(
        [sys.executable, "-m", "meshnet_cli", "run", "--model", str(checkpoint), "--port", "0",
         "--engine", "torch", "--dtype", "bfloat16", "--device", "cuda:999", "--threads", "1"],
        capture_output=True, text=True, timeout=120, env=clean_env(),
    )  # fmt: skip
    assert result.returncode == 2  # refused before anything starts (issue 22)
    assert result.stderr.startswith("meshnet run: --device cuda:999: "), result.stderr
    assert result.stderr.count("\n") == 1

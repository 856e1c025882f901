"""A stage's resident bytes from the headers, checked by hand arithmetic.

The small config (``small_config``): hidden 64, intermediate 128, 4 heads of
16, 2 KV heads, vocab 256, 4 layers. One layer's matrices, [rows, cols]:
q [64, 64], k [32, 64], v [32, 64], o [64, 64], gate [128, 64], up [128, 64],
down [64, 128]: 36864 values in all, 512 rows; two norms of 64.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from meshnet_model.engines.choice import usable_cores
from meshnet_model.engines.fit import fit_process
from meshnet_model.engines.footprint import (
    KV_AUTO_MAX,
    RUNTIME_BYTES,
    MemoryShortfall,
    held_matrix_bytes,
    parse_size,
    stage_footprint,
)
from meshnet_model.engines.torch.dense_tiles import scratch_bytes
from meshnet_model.split import plan_split
from meshnet_model.stage.costs import QUERY_BLOCK, chunk_cost
from meshnet_model.testing import random_weights, small_config, write_checkpoint
from meshnet_model.testing.gguf import write_gguf

MiB, GiB = 1024**2, 1024**3
VALUES, ROWS, NORMS = 36864, 512, 2 * 64 * 4
# int4pack: n*k/2 + (k/32)*n*4 per matrix; the k/32 groups times rows times 4:
# q 2*64, k 2*32, v 2*32, o 2*64, gate 2*128, up 2*128, down 4*64 = 1152 groups.
INT4_LAYER = VALUES // 2 + 1152 * 4 + NORMS  # 23552
INT4X2_LAYER = VALUES + 2 * 1152 * 4 + NORMS  # Q8_0: two int4pack halves, 46592
F32_LAYER = 4 * VALUES + NORMS  # 147968
HALF_LAYER = 2 * VALUES + NORMS  # 74240
EMBED = 256 * 64


def gguf(tmp_path: Path, qtype: str, **overrides: object) -> Path:
    config = small_config(**overrides)
    document = {**config.to_dict(), "model_type": "llama"}
    return write_gguf(tmp_path / f"m-{qtype}.gguf", document, random_weights(config), qtype=qtype)


def fp(path: Path, layers: range, engine: str, dtype: str, **kw: int):  # type: ignore[no-untyped-def]
    args = dict(kv_budget_bytes=GiB, max_chunk_tokens=2048, max_compute_bytes=GiB) | kw
    return stage_footprint(path, layers, engine=engine, dtype=dtype, **args)


def test_held_matrix_bytes_is_the_table() -> None:
    n, k = 64, 128
    for q4 in ("Q4_0", "Q4_1", "Q4_K"):
        assert held_matrix_bytes("torch", "keep", q4, n, k) == 4096 + 4 * 64 * 4
    # Q8_0: two exact int4pack halves; Q6_K (per-16 scales): dense bfloat16.
    assert held_matrix_bytes("torch", "keep", "Q8_0", n, k) == 2 * (4096 + 4 * 64 * 4)
    assert held_matrix_bytes("torch", "keep", "Q6_K", n, 256) == 2 * n * 256
    # Rows the kernel does not tile (not a multiple of 64): dense bfloat16.
    assert held_matrix_bytes("torch", "keep", "Q4_0", 100, k) == 2 * 100 * k
    for f in ("F32", "F16", "BF16"):  # a float matrix in a quantized file: bf16
        assert held_matrix_bytes("torch", "keep", f, n, k, quantized_file=True) == 2 * n * k
    assert held_matrix_bytes("torch", "keep", "F32", n, k) == 4 * n * k  # its own dtype
    assert held_matrix_bytes("torch", "keep", "bfloat16", n, k) == 2 * n * k
    assert held_matrix_bytes("torch", "float32", "Q4_0", n, k) == 4 * n * k
    assert held_matrix_bytes("torch", "bfloat16", "Q8_0", n, k) == 2 * n * k
    assert held_matrix_bytes("torch", "float16", "F32", n, k) == 2 * n * k
    assert held_matrix_bytes("numpy", "float32", "Q4_K", n, k) == 4 * n * k
    assert held_matrix_bytes("numpy", "keep", "Q4_K", n, k) == 4 * n * k
    assert held_matrix_bytes("numpy", "keep", "F16", n, k) == 2 * n * k
    assert held_matrix_bytes("numpy", "keep", "bfloat16", n, k) == 2 * n * k
    assert held_matrix_bytes("numpy", "bfloat16", "Q4_0", n, k) == 2 * n * k
    with pytest.raises(ValueError, match="engine"):
        held_matrix_bytes("jax", "keep", "F32", n, k)


def test_quantized_gguf_with_torch_keep_is_int4pack_and_the_mapped_embedding(
    tmp_path: Path,
) -> None:
    path = gguf(tmp_path, "Q4_0")
    first = fp(path, range(0, 2), "torch", "keep")
    assert first.form == "int4pack"
    assert first.weights == EMBED // 32 * 18 + 2 * INT4_LAYER  # the embedding in its file form
    last = fp(path, range(2, 4), "torch", "keep")
    head = 256 * 64 // 2 + 2 * 256 * 4  # lm_head [256, 64] int4pack
    assert last.weights == 2 * INT4_LAYER + head + 64 * 4
    assert first.kv == GiB and first.runtime == RUNTIME_BYTES["torch"]
    assert first.total == first.weights + first.kv + first.scratch + first.runtime
    q8 = gguf(tmp_path, "Q8_0")
    assert fp(q8, range(1, 3), "torch", "keep").weights == 2 * INT4X2_LAYER


def test_tied_head_is_a_second_matrix_only_where_torch_keeps_it_quantized(
    tmp_path: Path,
) -> None:
    path = gguf(tmp_path, "Q4_0", tie_word_embeddings=True)
    whole = fp(path, range(4), "torch", "keep")
    head = 256 * 64 // 2 + 2 * 256 * 4 + 64 * 4
    assert whole.weights == EMBED // 32 * 18 + 4 * INT4_LAYER + head
    # numpy holds the head as the embedding itself: one float32 copy.
    assert fp(path, range(4), "numpy", "float32").weights == 4 * EMBED + 4 * F32_LAYER + 256
    # A last stage without layer 0 holds the tied head alone.
    assert fp(path, range(3, 4), "numpy", "float32").weights == F32_LAYER + 4 * EMBED + 256


def test_numpy_and_dense_dtypes(tmp_path: Path) -> None:
    path = gguf(tmp_path, "Q4_0")
    assert fp(path, range(0, 2), "numpy", "float32").weights == 4 * EMBED + 2 * F32_LAYER
    assert fp(path, range(0, 2), "numpy", "keep").weights == 4 * EMBED + 2 * F32_LAYER
    assert fp(path, range(1, 2), "numpy", "bfloat16").weights == HALF_LAYER
    # torch with a dense dtype: every matrix, the embedding too.
    assert fp(path, range(0, 1), "torch", "bfloat16").weights == 2 * EMBED + HALF_LAYER
    assert fp(path, range(0, 1), "torch", "float32").weights == 4 * EMBED + F32_LAYER


def test_float_checkpoints_keep_their_own_dtype(tmp_path: Path) -> None:
    f16 = gguf(tmp_path, "F16")
    assert fp(f16, range(0, 1), "torch", "keep").weights == 2 * EMBED + HALF_LAYER
    assert fp(f16, range(0, 1), "numpy", "keep").weights == 2 * EMBED + HALF_LAYER
    directory = write_checkpoint(tmp_path / "bf16", small_config(), dtype="bfloat16")
    # Norms are float32 as held (4 bytes each) whatever the file's dtype.
    assert fp(directory, range(1, 2), "torch", "keep").weights == HALF_LAYER
    assert fp(directory, range(1, 2), "numpy", "float32").weights == F32_LAYER
    assert fp(directory, range(0, 1), "numpy", "float32").weights == 4 * EMBED + F32_LAYER


def test_scratch_is_the_chunk_cost_capped_and_block_shaped(tmp_path: Path) -> None:
    # Both engines attend in aligned blocks of QUERY_BLOCK queries (stage.batch);
    # a quantized torch stage holds its dense tiles' decode buffer too.
    path = gguf(tmp_path, "Q8_0")
    config = small_config()
    tiles = scratch_bytes(max(config.hidden_size, config.intermediate_size), usable_cores())
    for engine, block in (("numpy", QUERY_BLOCK), ("torch", QUERY_BLOCK)):
        for span, last in ((range(0, 2), False), (range(2, 4), True)):
            want = chunk_cost(config, batch=1, tokens=64, context=512, last=last,
                              query_block=block).total  # fmt: skip
            want += tiles if engine == "torch" else 0
            got = fp(path, span, engine, "keep", max_chunk_tokens=64).scratch
            assert got == want
    assert fp(path, range(0, 2), "numpy", "keep", max_compute_bytes=1000).scratch == 1000


def test_auto_kv_takes_what_is_left_up_to_1gib_and_refuses_under_64mib(tmp_path: Path) -> None:
    path = gguf(tmp_path, "Q4_0")
    args = dict(engine="numpy", dtype="float32", max_chunk_tokens=2048, max_compute_bytes=GiB)
    (roomy,) = fit_process(path, [range(4)], kv_budget_bytes="auto", limit=64 * GiB, **args)
    assert roomy.kv == KV_AUTO_MAX
    (free,) = fit_process(path, [range(4)], kv_budget_bytes="auto", limit=None, **args)
    assert free.kv == KV_AUTO_MAX
    limit = 512 * MiB
    (tight,) = fit_process(path, [range(4)], kv_budget_bytes="auto", limit=limit, **args)
    fixed = tight.weights + tight.scratch + tight.runtime
    assert tight.kv == limit - fixed - int(limit * 0.05)
    # The need is the least budget beside the rest, whatever the limit: a limit
    # of exactly that fits (the margin comes out of what is above it), one byte
    # less is refused, and the figure named is the same at any limit.
    least = fit_process(path, [range(4)], kv_budget_bytes="auto", limit=None, **args)
    (edge,) = fit_process(path, [range(4)], kv_budget_bytes="auto", limit=fixed + 64 * MiB, **args)
    assert edge.kv == 64 * MiB
    needs = set()
    for under in (MiB, fixed // 2, fixed + 64 * MiB - 1):
        with pytest.raises(MemoryShortfall, match="KV 64 MiB at least") as short:
            fit_process(path, [range(4)], kv_budget_bytes="auto", limit=under, **args)
        needs.add(str(short.value).split(" need ")[1].split(" (")[0])
    assert len(needs) == 1 and least
    # An explicit budget is checked as given, without the margin.
    (exact,) = fit_process(path, [range(4)], kv_budget_bytes=limit - fixed, limit=limit, **args)
    assert exact.total == limit
    with pytest.raises(MemoryShortfall) as refused:
        fit_process(path, [range(4)], kv_budget_bytes=limit - fixed + 1, limit=limit,
                    limit_source="cgroup memory.max of /x", **args)  # fmt: skip
    line = str(refused.value)
    assert "\n" not in line and line.startswith("layers 0:4 of m-Q4_0.gguf need ")
    assert "(weights 706 KiB float32, KV " in line  # 4*EMBED + 4*F32_LAYER + lm_head + norm
    assert "but this node may use 512 MiB (cgroup memory.max of /x)" in line
    assert f"--kv-budget-bytes {(limit - fixed) // MiB}MiB" in line


def test_the_message_names_what_would_fit(tmp_path: Path) -> None:
    path = gguf(tmp_path, "Q4_0", num_hidden_layers=8)
    args = dict(max_chunk_tokens=16, max_compute_bytes=GiB, kv_budget_bytes=MiB)
    (whole,) = fit_process(path, [range(8)], engine="numpy", dtype="float32", limit=None, **args)
    # Room for the runtime, the KV, the scratch, the embedding and 3 layers.
    limit = whole.runtime + MiB + whole.scratch + 4 * EMBED + 3 * F32_LAYER + 100
    with pytest.raises(MemoryShortfall) as refused:
        fit_process(path, [range(0, 6)], engine="numpy", dtype="float32", limit=limit,
                    limit_source="--memory-limit", **args)  # fmt: skip
    line = str(refused.value)
    assert ": 3 layers would fit" in line
    assert "--engine numpy --dtype bfloat16" in line or "--engine torch" in line


def test_one_process_counts_the_stages_and_one_runtime(tmp_path: Path) -> None:
    path = gguf(tmp_path, "Q4_0")
    args = dict(engine="numpy", dtype="float32", max_chunk_tokens=64, max_compute_bytes=GiB)
    stages = fit_process(path, [range(0, 2), range(2, 4)], kv_budget_bytes=8 * MiB,
                         limit=None, **args)  # fmt: skip
    need = sum(s.weights + s.kv + s.scratch for s in stages) + RUNTIME_BYTES["numpy"]
    fit_process(path, [range(0, 2), range(2, 4)], kv_budget_bytes=8 * MiB, limit=need, **args)
    with pytest.raises(MemoryShortfall, match=r"layers 0:2, 2:4 of m-Q4_0\.gguf in one process"):
        fit_process(path, [range(0, 2), range(2, 4)], kv_budget_bytes=8 * MiB, limit=need - 1,
                    who="this process", **args)  # fmt: skip


def test_plan_split_fits_each_machine_or_says_none_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshnet_model.__main__ import main

    path = gguf(tmp_path, "Q4_0", num_hidden_layers=8)
    args = dict(engine="numpy", dtype="float32", max_chunk_tokens=2048, max_compute_bytes=GiB)
    memories = [600 * MiB, 200 * MiB, 300 * MiB]
    split = plan_split(path, memories, **args)
    assert split[0].layers.start == 0 and split[-1].layers.stop == 8
    assert all(a.layers.stop == b.layers.start for a, b in itertools.pairwise(split))
    for stage, memory in zip(split, memories, strict=True):
        assert stage.total <= memory and stage.kv >= 64 * MiB
    with pytest.raises(MemoryShortfall, match="no split of the 8 layers"):
        plan_split(path, [100 * MiB, 100 * MiB], **args)
    assert main(["plan", str(path), "--engine", "numpy", "--memory", "600MiB,200MiB,300MiB"]) == 0
    out = capsys.readouterr().out
    assert "stage 2: --layers" in out and "of 300 MiB" in out
    assert main(["plan", str(path), "--memory", "100MiB,100MiB"]) == 1
    assert "no split of the 8 layers" in capsys.readouterr().err
    assert main(["plan", str(path), "--engine", "numpy", "--stages", "2"]) == 0
    out = capsys.readouterr().out
    assert "needs" in out and "numpy float32" in out
    assert parse_size("16GiB") == 16 * GiB and parse_size("1GB") == 10**9
    with pytest.raises(ValueError):
        parse_size("lots")

"""GGUF files as checkpoints: decoding, config from metadata (fail-closed), names, errors."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from meshnet_model import StageWeights
from meshnet_model.errors import CheckpointError
from meshnet_model.formats.config import LlamaConfig
from meshnet_model.formats.gguf.checkpoint import GGUFCheckpoint, GGUFFile, gguf_config, unpermute
from meshnet_model.formats.gguf.quants import GGML_TYPES, decode
from meshnet_model.rope import Rope
from meshnet_model.source import load_config, model_name, open_checkpoint
from meshnet_model.testing import random_weights, small_config
from meshnet_model.testing.gguf import permute, write_gguf
from support.gateway import clean_env

QUANTIZABLE = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_dequantization_equals_the_gguf_package_bit_for_bit(name: str) -> None:
    kind = gguf.GGMLQuantizationType[name]
    data = np.random.default_rng(5).standard_normal((6, 256)).astype(np.float32) * 3
    packed = gguf.quants.quantize(data, kind)
    want = gguf.quants.dequantize(packed, kind).astype(np.float32)
    ours = decode(np.ascontiguousarray(packed).view(np.uint8), GGML_TYPES[int(kind)], data.shape)
    assert np.array_equal(np.asarray(ours, np.float32).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_k_quant_dequantization_equals_the_gguf_package_bit_for_bit(name: str) -> None:
    # The package cannot quantize these: random blocks with finite float16 scales.
    kind = gguf.GGMLQuantizationType[name]
    block, nbytes = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(6)
    raw = rng.integers(0, 256, (5, 3 * nbytes), dtype=np.uint8)
    scale_offsets = (0, 2) if name == "Q4_K" else (208,)
    for b in range(3):
        for offset in scale_offsets:
            scale = np.float16(rng.uniform(1e-3, 0.1, (5, 1))).view(np.uint8)
            raw[:, b * nbytes + offset : b * nbytes + offset + 2] = scale
    want = gguf.quants.dequantize(raw, kind)
    ours = decode(raw, GGML_TYPES[int(kind)], (5, 3 * block))
    assert np.array_equal(ours.view(np.uint32), want.view(np.uint32))


def test_unpermute_inverts_llama_cpps_permutation() -> None:
    rows = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert np.array_equal(unpermute(permute(rows, 8), 8), rows)
    assert not np.array_equal(permute(rows, 8), rows)
    # Per head: the file's rows 2i and 2i+1 are HF's rows i and i + d/2.
    head = permute(rows, 8)[:16, 0]
    assert list(head[:4]) == [rows[0, 0], rows[8, 0], rows[1, 0], rows[9, 0]]


def _write(tmp_path: Path, name: str = "m.gguf", **kw: object) -> Path:
    config = kw.pop("config", None) or small_config().to_dict()
    weights = kw.pop("weights", None) or random_weights(small_config(), seed=2)
    return write_gguf(tmp_path / name, config, weights, **kw)  # type: ignore[arg-type]


def test_config_comes_from_metadata_and_passes_the_one_config_reader(tmp_path: Path) -> None:
    path = _write(tmp_path)
    raw = gguf_config(GGUFFile(path))
    assert raw["model_type"] == "llama" and raw["rope_scaling"] is None
    # GGUF stores floats as float32 (transformers reads the same widened value).
    want = dataclasses.replace(small_config(), rms_norm_eps=float(np.float32(1e-5)))
    assert LlamaConfig.from_dict(raw) == want
    assert load_config(path) == want and model_name(path) == "m"


def test_a_stage_reads_only_its_own_tensors_with_hf_names_and_shapes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = random_weights(small_config(), seed=2)
    path = _write(tmp_path, weights=weights)
    ckpt = open_checkpoint(path)
    assert isinstance(ckpt, GGUFCheckpoint) and ckpt.tensors_read() == []  # opening decodes nothing
    for name, value in weights.items():
        assert name in ckpt and np.array_equal(ckpt.tensor(name), value), name
    decoded: list[str] = []
    original = GGUFFile.array

    def spy(self: GGUFFile, name: str) -> np.ndarray:
        decoded.append(name)
        return original(self, name)

    monkeypatch.setattr(GGUFFile, "array", spy)
    middle = StageWeights.load(path, range(1, 3))
    assert middle.files == ["m.gguf"] and middle.embed is None and middle.lm_head is None
    assert sorted({n.split(".")[1] for n in decoded}) == ["1", "2"]
    assert all(n.startswith(("blk.1.", "blk.2.")) for n in decoded)
    decoded.clear()
    StageWeights.load(path, range(3, 4))
    assert {n for n in decoded if not n.startswith("blk.3.")} == {
        "output_norm.weight",
        "output.weight",
    }


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0"])
def test_dtype_of_a_stage_from_each_encoding(tmp_path: Path, qtype: str) -> None:
    path = _write(tmp_path, qtype=qtype)
    assert StageWeights.load(path, dtype="float32").dtype == "float32"
    assert StageWeights.load(path, dtype="bfloat16").dtype == "bfloat16"
    # keep: a float encoding stays as the file holds it (mapped); a quantized one is float32.
    keep = StageWeights.load(path, dtype="keep").dtype
    assert keep == {"F16": "float16", "BF16": "bfloat16", "Q8_0": "float32"}[qtype]
    assert GGUFCheckpoint(path).dtypes(["model.layers.0.mlp.up_proj.weight"]) == {qtype}


def test_llama3_rope_freqs_become_the_llama3_rope_scaling(tmp_path: Path) -> None:
    # llama.cpp writes Llama 3.x rope scaling as per-frequency factors only.
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    shape = {"head_dim": 64, "rope_theta": 500000.0, "max_position_embeddings": 131072}
    want = small_config(rope_scaling=scaling, **shape)
    base = Rope(small_config(**shape)).inv_freq.astype(np.float64)
    factors = (base / Rope(want).inv_freq.astype(np.float64)).astype(np.float32)
    assert len(set(factors.tolist())) > 2  # a real ramp between 1 and 8
    weights = random_weights(want, seed=2)
    path = _write(tmp_path, config=want.to_dict(), weights=weights, rope_freqs=factors)
    got = load_config(path)
    assert got.rope_scaling == want.rope_scaling
    assert np.array_equal(Rope(got).inv_freq, Rope(want).inv_freq)
    odd = factors.copy()
    odd[0] = 3.0
    bad = _write(tmp_path, "odd.gguf", config=want.to_dict(), weights=weights, rope_freqs=odd)
    with pytest.raises(CheckpointError, match="not Llama 3 rope scaling"):
        load_config(bad)


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"llama.attention.clamp_kqv": 8.0}, "llama.attention.clamp_kqv = 8.0 is not supported"),
        ({"llama.rope.scaling.type": "longrope"}, "rope.scaling.type 'longrope' is not supported"),
        ({"llama.rope.dimension_count": 8}, "partial rotary"),
        ({"split.count": 3}, "split GGUF files"),
        ({"mamba.ssm.conv_kernel": 4}, "mamba.ssm.conv_kernel = 4 is not supported"),
        ({"llama.expert_count": 8}, "llama.expert_count = 8 is not supported"),
    ],
)
def test_metadata_that_would_change_the_math_is_refused_by_name(
    tmp_path: Path, metadata: dict[str, object], message: str
) -> None:
    config = small_config().to_dict()
    weights = random_weights(small_config(), seed=2)
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(4)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_feed_forward_length(128)
    for key, value in metadata.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)  # type: ignore[arg-type]
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    del config
    with pytest.raises(CheckpointError, match=message):
        load_config(path)


def test_zero_expert_counts_are_a_dense_model(tmp_path: Path) -> None:
    path = _write(tmp_path, extra_metadata={"llama.expert_count": 0, "llama.expert_used_count": 0})
    assert load_config(path).num_hidden_layers == 4


def _node(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshnet_node", "--port", "0", "--model", str(path)],
        capture_output=True, text=True, env=clean_env(), timeout=120,
    )  # fmt: skip


@pytest.mark.slow
def test_bad_gguf_files_are_one_line_and_exit_2_at_node_start(tmp_path: Path) -> None:
    good = _write(tmp_path, "good.gguf", qtype="Q8_0")
    data = good.read_bytes()
    cases = {}
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) - 1000])
    cases[truncated] = "not a readable GGUF file"
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGML" + bytes(100))
    cases[garbage] = "not a readable GGUF file"
    # Another architecture: the same file with its name changed in place.
    other = tmp_path / "other.gguf"
    other.write_bytes(data.replace(b"llama", b"gemma", 1))
    cases[other] = "GGUF architecture 'gemma' is not supported"
    # A tensor type we do not decode (Q5_0): the type id patched in the tensor table.
    unsupported = _write(tmp_path, "q5k.gguf", qtype="Q8_0")
    reader = gguf.GGUFReader(unsupported)
    field = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight").field
    offset = field.offset + sum(int(p.nbytes) for p in field.parts[:4])
    del reader, field
    patched = bytearray(unsupported.read_bytes())
    assert patched[offset] == int(gguf.GGMLQuantizationType.Q8_0)
    patched[offset] = int(gguf.GGMLQuantizationType.Q5_0)
    unsupported.write_bytes(bytes(patched))
    cases[unsupported] = "is Q5_0, a type this package does not decode"
    for path, message in cases.items():
        done = _node(path)
        assert done.returncode == 2, (path, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (path, done.stderr)
        assert lines[0].startswith("meshnet-node: cannot load --model")


def test_the_fast_reader_reads_every_field_as_the_gguf_package_does(tmp_path: Path) -> None:
    from meshnet_model.formats.gguf.file import _field_value
    from support.gguf import vocab_for

    for kind in ("llama", "qwen2"):
        vocab = vocab_for(kind)
        config = small_config(vocab_size=len(vocab.tokens))
        path = _write(tmp_path, f"{kind}.gguf", config=config.to_dict(),
                      weights=random_weights(config), vocab=vocab, qtype="Q4_0")  # fmt: skip
        stock = gguf.GGUFReader(path)
        ours = GGUFFile(path)
        assert ours.keys() == list(stock.fields)
        for key, field in stock.fields.items():
            assert ours.get(key) == _field_value(field) == field.contents(), key
        assert ours.get("tokenizer.ggml.tokens") == vocab.tokens
        for tensor in stock.tensors:
            assert np.array_equal(ours.tensors[tensor.name].data, tensor.data)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(path.read_bytes()[:3000])  # inside the token list
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        GGUFFile(truncated)


def test_plan_splits_a_gguf_file_by_its_quantized_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshnet_model.plan import main, plan_stages

    config = small_config(num_hidden_layers=6, tie_word_embeddings=True)
    path = _write(tmp_path, config=config.to_dict(), weights=random_weights(config), qtype="Q8_0")
    stored = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    embed = 256 * 64 // 32 * 34  # Q8_0: 34 bytes per 32 values
    plan = plan_stages(path, 2)
    (a, b), (c, d) = (str(p["layers"]).split(":") for p in plan)
    assert (a, d) == ("0", "6") and b == c
    # Every tensor once, and the tied embedding again on the last stage.
    assert sum(int(p["checkpoint_bytes"]) for p in plan) == stored + embed  # type: ignore[call-overload]
    assert main(["plan", str(path), "--stages", "2", "--json"]) == 0
    assert f'"{plan[1]["layers"]}"' in capsys.readouterr().out
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    assert main(["plan", str(bad)]) == 2
    assert "not a readable GGUF file" in capsys.readouterr().err

"""meshnet_model's numerics, against a slow, obviously-correct reference.

transformers/torch are not installed here (and too big to add), so the
reference is written out below in float64 with explicit loops: per token,
per head, rotary pairs (i, i + head_dim/2) turned by their angle, softmax over
the keys at or before the query. The fast path must agree with it within
float32 rounding; splits must agree with one stage bit for bit; chunked
prefill and decode must agree with one whole pass within TOLERANCE.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet_model import (
    Checkpoint,
    CheckpointError,
    ConfigError,
    KVBudget,
    KVBudgetExceeded,
    LlamaConfig,
    Rope,
    StageInvariantError,
    StageModel,
    StageRunner,
    StageWeights,
    parse_layers,
)
from meshnet_model.rope import apply_rope
from meshnet_model.testing import random_weights, small_config, write_checkpoint

# Chunked prefill vs one chunk, and decode vs recompute: max |difference| of the
# logits within this many times the logits' scale (max(1, max |logit|)).
TOLERANCE = 1e-5


def within_tolerance(a: np.ndarray, b: np.ndarray) -> bool:
    scale = max(1.0, float(np.abs(b).max()))
    return float(np.abs(a - b).max()) <= TOLERANCE * scale


# ------------------------------------------------------------------ reference


def reference_logits(config: LlamaConfig, w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """LlamaForCausalLM's last-position logits, float64, one loop at a time."""
    c = config
    d, heads, kv_heads = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    half = d // 2
    g = {k: v.astype(np.float64) for k, v in w.items()}

    def norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return weight * x / math.sqrt(float(np.mean(x * x)) + c.rms_norm_eps)

    def rotate(vec: np.ndarray, pos: int) -> np.ndarray:
        out = np.empty_like(vec)
        for i in range(half):
            angle = pos * c.rope_theta ** (-2 * i / d)
            a, b = vec[i], vec[i + half]
            out[i] = a * math.cos(angle) - b * math.sin(angle)
            out[i + half] = b * math.cos(angle) + a * math.sin(angle)
        return out

    xs = [g["model.embed_tokens.weight"][t].copy() for t in ids]
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        normed = [norm(x, g[p + "input_layernorm.weight"]) for x in xs]
        qs = [g[p + "self_attn.q_proj.weight"] @ x for x in normed]
        ks = [g[p + "self_attn.k_proj.weight"] @ x for x in normed]
        vs = [g[p + "self_attn.v_proj.weight"] @ x for x in normed]
        new = []
        for t in range(len(ids)):
            heads_out = []
            for h in range(heads):
                kvh = h // (heads // kv_heads)
                q = rotate(qs[t][h * d : (h + 1) * d], t)
                scores = [
                    float(q @ rotate(ks[s][kvh * d : (kvh + 1) * d], s)) / math.sqrt(d)
                    for s in range(t + 1)
                ]
                top = max(scores)
                weights = [math.exp(x - top) for x in scores]
                total = sum(weights)
                heads_out.append(
                    sum(wt / total * vs[s][kvh * d : (kvh + 1) * d] for s, wt in enumerate(weights))
                )
            attn = g[p + "self_attn.o_proj.weight"] @ np.concatenate(heads_out)
            x = xs[t] + attn
            h2 = norm(x, g[p + "post_attention_layernorm.weight"])
            gate = g[p + "mlp.gate_proj.weight"] @ h2
            up = g[p + "mlp.up_proj.weight"] @ h2
            x = x + g[p + "mlp.down_proj.weight"] @ (gate / (1 + np.exp(-gate)) * up)
            new.append(x)
        xs = new
    head = g.get("lm_head.weight", g["model.embed_tokens.weight"])
    return head @ norm(xs[-1], g["model.norm.weight"])


def prompt(n: int, vocab: int = 256, seed: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (1, n)).astype(np.int32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"), small_config(), seed=11)


# ------------------------------------------------------------------ against the reference


@pytest.mark.parametrize("tied", [False, True])
def test_forward_matches_the_slow_reference(tmp_path: Path, tied: bool) -> None:
    config = small_config(num_hidden_layers=2, tie_word_embeddings=tied)
    weights = random_weights(config, seed=2)
    write_checkpoint(tmp_path, config, weights=weights)
    ids = prompt(9)
    got = StageRunner.load(tmp_path).run("s", 0, ids)[0]
    want = reference_logits(config, weights, ids[0].tolist())
    assert np.allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max()), np.abs(
        got - want
    ).max()
    # And the reference notices a wrong model: another seed is far away.
    other = reference_logits(config, random_weights(config, seed=3), ids[0].tolist())
    assert not np.allclose(got, other, atol=1e-2)


def test_rope_dot_products_depend_only_on_the_distance() -> None:
    rope = Rope(small_config())
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 16)).astype(np.float32)

    def score(m: int, n: int) -> float:
        cos, sin = rope.cos_sin(0, 64)
        return float(apply_rope(q, cos[m], sin[m]) @ apply_rope(k, cos[n], sin[n]))

    assert math.isclose(score(10, 3), score(40, 33), rel_tol=1e-4)
    assert not math.isclose(score(10, 3), score(10, 4), rel_tol=1e-4)


def test_rope_scaling_variants() -> None:
    base = Rope(small_config()).inv_freq.astype(np.float64)
    linear = Rope(small_config(rope_scaling={"type": "linear", "factor": 4.0})).inv_freq
    assert np.allclose(linear, base / 4, rtol=1e-6)

    llama3 = Rope(small_config(max_position_embeddings=8192, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    })).inv_freq  # fmt: skip
    wavelen = 2 * math.pi / base
    high, low = wavelen < 64 / 4, wavelen > 64 / 1
    assert high.any() and low.any() and (~high & ~low).any()  # all three bands are exercised
    assert np.allclose(llama3[high], base[high], rtol=1e-6)  # high frequencies kept
    assert np.allclose(llama3[low], base[low] / 8, rtol=1e-6)  # low ones interpolated
    middle = ~high & ~low
    assert np.all((llama3[middle] < base[middle]) & (llama3[middle] > base[middle] / 8))

    yarn_rope = Rope(
        small_config(
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        )
    )
    assert math.isclose(yarn_rope.attention_factor, 0.1 * math.log(4.0) + 1)
    assert math.isclose(yarn_rope.inv_freq[0], base[0], rel_tol=1e-6)  # extrapolated
    assert math.isclose(yarn_rope.inv_freq[-1], base[-1] / 4, rel_tol=1e-6)  # interpolated
    cos, _ = yarn_rope.cos_sin(0, 1)
    assert np.allclose(cos, yarn_rope.attention_factor)  # cos(0) scaled by the factor

    dynamic = Rope(
        small_config(max_position_embeddings=64, rope_scaling={"type": "dynamic", "factor": 2.0})
    )
    assert np.array_equal(dynamic.cos_sin(0, 64)[0], Rope(small_config()).cos_sin(0, 64)[0])
    assert not np.array_equal(dynamic.cos_sin(0, 65)[0][:64], dynamic.cos_sin(0, 64)[0])

    with pytest.raises(ConfigError, match="longrope"):
        small_config(rope_scaling={"rope_type": "longrope", "factor": 2.0})


# ------------------------------------------------------------------ exactness


def test_any_split_is_bit_identical_to_one_stage(checkpoint: Path) -> None:
    ids = prompt(13)
    want = StageRunner.load(checkpoint).run("s", 0, ids)
    for splits in ([(0, 1), (1, 4)], [(0, 3), (3, 4)], [(0, 1), (1, 2), (2, 4)],
                   [(0, 1), (1, 2), (2, 3), (3, 4)]):  # fmt: skip
        x: np.ndarray = ids
        for a, b in splits:
            x = StageRunner.load(checkpoint, range(a, b)).run("s", 0, x)
        assert np.array_equal(x, want), splits


@pytest.mark.parametrize("chunk", [1, 3, 7, 16])
def test_chunked_prefill_equals_one_chunk_within_tolerance(checkpoint: Path, chunk: int) -> None:
    ids = prompt(29)
    want = StageRunner.load(checkpoint).run("s", 0, ids)
    runner = StageRunner.load(checkpoint)
    for lo in range(0, ids.shape[1], chunk):
        got = runner.run("s", lo, ids[:, lo : lo + chunk])
    assert within_tolerance(got, want), np.abs(got - want).max()


def test_decode_with_the_cache_equals_recomputing(checkpoint: Path) -> None:
    ids = prompt(24)
    runner = StageRunner.load(checkpoint)
    runner.run("s", 0, ids[:, :16])
    for t in range(16, 24):
        step = runner.run("s", t, ids[:, t : t + 1])
        again = StageRunner.load(checkpoint).run("r", 0, ids[:, : t + 1])
        assert within_tolerance(step, again), (t, np.abs(step - again).max())


def test_batches_are_independent_rows(checkpoint: Path) -> None:
    ids = np.concatenate([prompt(8, seed=1), prompt(8, seed=2)])
    both = StageRunner.load(checkpoint).run("s", 0, ids)
    one = StageRunner.load(checkpoint).run("s", 0, ids[1:])
    assert both.shape == (2, 256)
    assert within_tolerance(both[1:], one)


# ------------------------------------------------------------------ loading


def test_sharded_and_single_file_load_the_same(tmp_path: Path) -> None:
    config = small_config()
    single = write_checkpoint(tmp_path / "single", config, seed=4)
    sharded = write_checkpoint(tmp_path / "sharded", config, seed=4, shards=3)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    ids = prompt(10)
    assert np.array_equal(StageRunner.load(single).run("s", 0, ids),
                          StageRunner.load(sharded).run("s", 0, ids))  # fmt: skip
    # A stage opens only the shards holding its own tensors.
    last = StageWeights.load(sharded, range(3, 4))
    own = ("model.norm.weight", "lm_head.weight")
    owners = {
        file
        for name, file in index["weight_map"].items()
        if name.startswith("model.layers.3.") or name in own
    }
    assert set(last.files) == owners
    assert last.embed is None and last.lm_head is not None


def test_a_bf16_checkpoint_loads_mmapped_and_matches_safe_open(tmp_path: Path) -> None:
    config = small_config()
    path = write_checkpoint(tmp_path, config, seed=6, dtype="bfloat16")
    ckpt = Checkpoint(path)
    for name in ckpt.weight_map:
        mapped, copied = ckpt.tensor(name), ckpt.tensor(name, mmap=False)
        assert mapped.dtype == np.dtype(ml_dtypes.bfloat16) == copied.dtype
        assert mapped.tobytes() == copied.tobytes()
    kept = StageWeights.load(path, dtype="keep")
    assert kept.dtype == "bfloat16" and isinstance(kept.blocks[0].q.base, np.memmap | np.ndarray)
    widened = StageWeights.load(path, dtype="float32")
    assert widened.dtype == "float32"
    ids = prompt(7)
    a = StageModel(kept)
    b = StageModel(widened)
    budget = KVBudget(1 << 20)
    out_keep = a.forward(ids, a.new_cache(budget, 1), 0)
    out_f32 = b.forward(ids, b.new_cache(budget, 1), 0)
    # bf16 -> float32 is exact, so holding the bf16 bytes computes the same numbers.
    assert np.array_equal(out_keep, out_f32)
    # A float16 copy is another rounding of the same weights: close, not equal.
    half = StageModel(StageWeights.load(path, dtype="float16"))
    assert half.weights.dtype == "float16"
    assert np.allclose(half.forward(ids, half.new_cache(budget, 1), 0), out_f32, atol=0.1)


def test_bad_checkpoints_and_configs_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        LlamaConfig.from_dir(tmp_path)
    with pytest.raises(ConfigError, match='model_type="gpt2" is not supported'):
        LlamaConfig.from_dict({**small_config().to_dict(), "model_type": "gpt2"})
    with pytest.raises(ConfigError, match="multiple of num_key_value_heads"):
        small_config(num_key_value_heads=3)
    path = write_checkpoint(tmp_path / "c", small_config(), seed=1)
    wrong = small_config(hidden_size=32, head_dim=8)
    with pytest.raises(CheckpointError, match="shape"):
        StageWeights.load(path, config=wrong)
    (path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(CheckpointError, match="header length"):
        Checkpoint(path)
    with pytest.raises(ValueError, match="the model has 4 layers"):
        parse_layers("2:9", 4)


# ------------------------------------------------------------------ KV cache


def test_kv_budget_refuses_growth_and_leaves_the_cache_usable(checkpoint: Path) -> None:
    weights = StageWeights.load(checkpoint)
    per_position = 2 * 4 * 2 * 16 * 4  # K and V x layers x kv heads x head_dim x float32
    runner = StageRunner(weights, kv_budget_bytes=40 * per_position)
    ids = prompt(20)
    runner.run("a", 0, ids[:, :10])
    assert runner.kv_bytes_in_use == 16 * per_position  # the smallest capacity
    runner.run("a", 10, ids[:, 10:])
    assert runner.kv_bytes_in_use == 32 * per_position  # doubled, not grown to 20
    with pytest.raises(KVBudgetExceeded):
        runner.run("b", 0, prompt(9))  # needs 9 more positions; only 8 left
    assert runner.kv_bytes_in_use == 32 * per_position
    runner.run("b", 0, prompt(8))  # exactly what fits: no doubling then
    assert runner.kv_bytes_in_use == 40 * per_position
    assert runner.end_session("a") == 32 * per_position
    assert runner.end_session("b") == 8 * per_position and runner.kv_bytes_in_use == 0


def test_a_leftover_of_a_cancelled_chunk_is_dropped_on_retry(checkpoint: Path) -> None:
    ids = prompt(12)
    clean = StageRunner.load(checkpoint)
    clean.run("s", 0, ids[:, :8])
    want = clean.run("s", 8, ids[:, 8:])
    runner = StageRunner.load(checkpoint)
    runner.run("s", 0, ids[:, :8])
    runner.run("s", 8, ids[:, 8:])  # computed, but say its run was reported failed...
    again = runner.run("s", 8, ids[:, 8:])  # ...so the node offers it again at 8
    assert np.array_equal(again, want)  # not attending to its own leftover keys


def test_non_first_stage_computing_a_suffix_is_refused_by_name(checkpoint: Path) -> None:
    class SuffixOnly(StageModel):
        def _layers(self, x, batch):  # type: ignore[no-untyped-def]
            return super()._layers(x, batch)[1:]  # drops the first position

    model = SuffixOnly(StageWeights.load(checkpoint, range(2, 4)))
    hidden = np.zeros((1, 4, 64), np.float32)
    with pytest.raises(StageInvariantError, match="must execute the full range"):
        model.forward(hidden, model.new_cache(KVBudget(1 << 20), 1), 0)


def test_a_cache_ended_mid_compute_gives_its_bytes_back_once(checkpoint: Path) -> None:
    from meshnet_model import SessionEnded

    runner = StageRunner.load(checkpoint, kv_budget_bytes=1 << 20)
    ids = prompt(20)
    runner.run("s", 0, ids[:, :10])
    cache = runner._lives["s"].cache
    assert cache is not None
    held = runner.kv_bytes_in_use
    assert runner.end_session("s") == held and runner.kv_bytes_in_use == 0
    assert cache.close() == 0  # idempotent: never given back twice
    # The chunk that was computing on it cannot grow it any more...
    with pytest.raises(SessionEnded):
        cache.reserve(20)
    assert runner.kv_bytes_in_use == 0
    # ...and the session id starts over cleanly.
    fresh = runner.run("s", 0, ids[:, :10])
    assert np.array_equal(fresh, StageRunner.load(checkpoint).run("x", 0, ids[:, :10]))


@functools.cache
def _weights(path: Path) -> StageWeights:
    return StageWeights.load(path)


@settings(max_examples=12, deadline=None)
@given(cuts=st.lists(st.integers(1, 23), max_size=5, unique=True))
def test_any_chunking_of_a_prompt_is_within_tolerance(checkpoint: Path, cuts: list[int]) -> None:
    ids = prompt(24)
    want = StageRunner(_weights(checkpoint)).run("w", 0, ids)
    runner = StageRunner(_weights(checkpoint))
    bounds = [0, *sorted(cuts), 24]
    for lo, hi in itertools.pairwise(bounds):
        got = runner.run("s", lo, ids[:, lo:hi])
    assert within_tolerance(got, want), (bounds, np.abs(got - want).max())


def test_a_non_float_weight_is_refused_by_name(tmp_path: Path) -> None:
    config = small_config()
    path = write_checkpoint(tmp_path, config)
    # write_checkpoint casts to the asked dtype: write the int tensor by hand.
    from safetensors.numpy import save_file

    tensors = random_weights(config)
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((128, 64), np.int32)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"up_proj\.weight: dtype int32 is not a float type"):
        StageWeights.load(path)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_damaged_safetensors_file_is_a_checkpoint_error_never_a_crash(
    checkpoint: Path, data: st.DataObject, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from meshnet_model import SafetensorsFile

    raw = bytearray((checkpoint / "model.safetensors").read_bytes()[:4096])
    header_end = 8 + int.from_bytes(raw[:8], "little")
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, min(header_end, len(raw)) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    path = tmp_path_factory.mktemp("bad") / "model.safetensors"
    path.write_bytes(bytes(raw[:cut]))
    try:
        f = SafetensorsFile(path)
        for name in f:
            f.tensor(name)  # offsets were checked against the file: reads stay inside it
    except CheckpointError:
        pass


def test_plan_splits_a_checkpoint_into_contiguous_stages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshnet_model.plan import main, plan_stages

    config = small_config(num_hidden_layers=6, tie_word_embeddings=True)
    path = write_checkpoint(tmp_path, config, seed=3, shards=2, dtype="bfloat16")
    for stages in (1, 2, 3, 6):
        plan = plan_stages(path, stages)
        ranges = [parse_layers(str(p["layers"]), 6) for p in plan]
        assert len(ranges) == stages and ranges[0].start == 0 and ranges[-1].stop == 6
        assert all(a.stop == b.start for a, b in itertools.pairwise(ranges))
        per_token = sum(int(p["kv_bytes_per_token"]) for p in plan)  # type: ignore[call-overload]
        assert per_token == 6 * 2 * 2 * 16 * 4
        # The ranges load, and together compute what one stage does.
        ids = prompt(5)
        x: np.ndarray = ids
        for r in ranges:
            x = StageRunner.load(path, r).run("s", 0, x)
        assert np.array_equal(x, StageRunner.load(path).run("s", 0, ids))
    # A tied head maps the embedding on the first and the last stage.
    embed = 256 * 64 * 2
    two = plan_stages(path, 2)
    assert int(two[0]["checkpoint_bytes"]) > embed and int(two[1]["checkpoint_bytes"]) > embed  # type: ignore[call-overload]
    assert main(["plan", str(path), "--stages", "3", "--json"]) == 0
    assert [p["layers"] for p in json.loads(capsys.readouterr().out)] == [
        p["layers"] for p in plan_stages(path, 3)
    ]
    assert main(["plan", str(path), "--stages", "7"]) == 2
    assert "stages must be 1..6" in capsys.readouterr().err

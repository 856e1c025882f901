"""The weights cache of a quantized GGUF stage (``engines.torch.weight_cache``):
a stage mapped from the cache computes the same bits as one repacked from
the file; a cache file that is corrupt, cut short, written for another stage
or not ours is ignored and written again — never a wrong answer, never an
error; the directory is the operator's and others may not write to it."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from meshnet_model import StageRunner
from meshnet_model.engines.torch import load_torch_runner
from meshnet_model.engines.torch.weight_cache import cache_directory, checked_directory
from meshnet_model.engines.torch.weight_file import MAGIC
from meshnet_model.stage.kv_cache import KVBudget
from meshnet_model.testing.random_gguf import TINY, TINY_WEIGHT_STD, write_random_gguf
from support.gguf import build_model, write_k_quant_gguf

LAYERS = TINY["num_hidden_layers"]
SPANS = (range(0, 1), range(1, LAYERS))  # the first stage maps the embedding, the last ties it
IDS = np.array([[(13 * i + 7) % TINY["vocab_size"] for i in range(11)]], np.int64)


@pytest.fixture(scope="module", params=["Q4_0", "Q8_0"])
def gguf_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_gguf(tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf",
                             TINY, request.param, seed=7, weight_std=TINY_WEIGHT_STD)  # fmt: skip


def _load(path: Path, cache: Path | str = "off", layers: range | None = None) -> StageRunner:
    return load_torch_runner(path, layers, dtype="keep", weights_cache=str(cache))


def _written(runner: StageRunner) -> Path:
    """The cache file the load wrote, once its writer is done."""
    status = runner.model.weights.cache
    assert status.state in ("writing", "written"), status.report()  # built, not mapped
    assert status.finished.wait(60), "the writer did not finish"
    assert status.state == "written", status.report()
    return Path(status.path)


def _chain(runners: list[StageRunner]) -> np.ndarray:
    """Every stage's output for ``IDS`` (hidden states, then the last
    position's logits), one forward each, end to end as bytes."""
    x: np.ndarray = IDS
    outputs = []
    for runner in runners:
        model = runner.model
        x = model.forward(x, model.new_cache(KVBudget(1 << 26), 1), 0)
        outputs.append(np.ascontiguousarray(x).view(np.uint8).reshape(-1))
    return np.concatenate(outputs)


def test_a_mapped_stage_computes_the_bits_of_a_repacked_one(gguf_file: Path,
                                                            tmp_path: Path) -> None:  # fmt: skip
    fresh = [_load(gguf_file, layers=span) for span in SPANS]
    first = [_load(gguf_file, tmp_path, span) for span in SPANS]
    files = [_written(runner) for runner in first]
    again = [_load(gguf_file, tmp_path, span) for span in SPANS]
    assert len(set(files)) == 2  # one file a layer range
    for made, mapped, path in zip(first, again, files, strict=True):
        report = mapped.model.describe()
        assert report["weights_cache"] == {"state": "mapped", "path": str(path),
                                           "bytes": path.stat().st_size}  # fmt: skip
        # Truthful memory: the same held bytes and forms, the mapped share said.
        assert report["weights_bytes"] == made.model.describe()["weights_bytes"]
        assert report["weights_held"] == made.model.describe()["weights_held"]
        assert 0 < report["weights_mapped_bytes"] <= path.stat().st_size
        assert made.model.describe()["weights_mapped_bytes"] == 0
    want = _chain(fresh)
    assert want.size == 4 * IDS.size * TINY["hidden_size"] + 4 * TINY["vocab_size"]
    assert np.array_equal(_chain(first), want)
    assert np.array_equal(_chain(again), want)


def test_dense_matrices_of_a_k_quant_mix_are_cached_too(tmp_path: Path) -> None:
    """Q4_K int4pack and Q6_K held dense in bfloat16, both from the file."""
    path = write_k_quant_gguf(tmp_path, build_model("llama", layers=2, hidden=256))
    fresh = _load(path)
    _written(_load(path, tmp_path / "cache"))
    mapped = _load(path, tmp_path / "cache")
    assert mapped.model.weights.cache.state == "mapped"
    assert "bfloat16" in mapped.model.describe()["weights_held"]
    ids = IDS % mapped.model.config.vocab_size
    got, want = (
        r.model.score(ids, r.model.new_cache(KVBudget(1 << 26), 1)) for r in (mapped, fresh)
    )
    assert np.array_equal(got, want)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x40  # a bit of the last tensor's data
    path.write_bytes(bytes(data))


def _cut(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 4096)


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(8192))


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _header_only(path: Path) -> None:
    path.write_bytes(MAGIC + (1 << 40).to_bytes(8, "little"))


def _foreign(path: Path) -> None:
    """The file another stage of the same model wrote, under this one's name."""
    source = path.parent.parent / "other"
    other = _load(Path(str(path.parent.parent / "model.gguf")), source, range(1, LAYERS))
    shutil.copyfile(_written(other), path)
    os.chmod(path, 0o600)


@pytest.mark.parametrize("spoil", [_flip, _cut, _garbage, _empty, _header_only, _foreign])
def test_a_bad_cache_file_is_ignored_and_written_again(spoil, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model = write_random_gguf(tmp_path / "model.gguf", TINY, "Q4_0", seed=3,
                              weight_std=TINY_WEIGHT_STD)  # fmt: skip
    cache = tmp_path / "cache"
    span = range(0, 1)
    path = _written(_load(model, cache, span))
    spoil(path)
    rebuilt = _load(model, cache, span)  # no error, and not from the spoiled file
    assert _written(rebuilt) == path
    want = _chain([_load(model, layers=span), _load(model, layers=range(1, LAYERS))])
    assert np.array_equal(_chain([rebuilt, _load(model, layers=range(1, LAYERS))]), want)
    mapped = _load(model, cache, span)  # the file written again is used
    assert mapped.model.weights.cache.state == "mapped"
    assert np.array_equal(_chain([mapped, _load(model, layers=range(1, LAYERS))]), want)


def test_a_symlink_in_the_cache_is_never_followed(tmp_path: Path) -> None:
    model = write_random_gguf(tmp_path / "model.gguf", TINY, "Q4_0", seed=3,
                              weight_std=TINY_WEIGHT_STD)  # fmt: skip
    cache = tmp_path / "cache"
    path = _written(_load(model, cache))
    aside = tmp_path / "aside.weights"
    path.rename(aside)
    path.symlink_to(aside)
    _written(_load(model, cache))
    assert not path.is_symlink()


def test_a_changed_model_file_is_not_read_from_its_old_cache(tmp_path: Path) -> None:
    """Another file at the same path (another seed): a new key, a new file; the
    old one, whose source changed, is deleted after the write."""
    model = tmp_path / "model.gguf"
    cache = tmp_path / "cache"
    write_random_gguf(model, TINY, "Q4_0", seed=3, weight_std=TINY_WEIGHT_STD)
    old = _written(_load(model, cache))
    write_random_gguf(model, TINY, "Q4_0", seed=4, weight_std=TINY_WEIGHT_STD)
    os.utime(model, ns=(1, 1))  # even with an mtime set back, the sampled digest differs
    changed = _load(model, cache)
    new = _written(changed)
    assert new != old and not old.exists()
    fresh = _load(model)
    ids, budget = IDS, KVBudget(1 << 26)
    got = changed.model.score(ids, changed.model.new_cache(budget, 1))
    assert np.array_equal(got, fresh.model.score(ids, fresh.model.new_cache(budget, 1)))


def test_files_not_ours_are_left_alone(tmp_path: Path) -> None:
    model = write_random_gguf(tmp_path / "model.gguf", TINY, "Q4_0", seed=3,
                              weight_std=TINY_WEIGHT_STD)  # fmt: skip
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    theirs = [cache / "yolo.weights", cache / "notes.txt", cache / ".x.tmp"]
    for path in theirs:
        path.write_bytes(b"not a meshnet file")
    _written(_load(model, cache))
    assert all(path.exists() for path in theirs)


def test_the_directory_must_be_the_user_s_alone(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    for mode in (0o777, 0o770, 0o1777):
        shared.chmod(mode)
        with pytest.raises(ValueError, match="writable by others"):
            checked_directory(shared)
    shared.chmod(0o755)
    assert checked_directory(shared) == shared
    made = checked_directory(tmp_path / "a" / "b")
    assert made.is_dir() and made.stat().st_mode & 0o777 == 0o700
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"not a directory|Not a directory|File exists"):
        checked_directory(tmp_path / "file")


def test_a_shared_directory_refuses_the_load(tmp_path: Path) -> None:
    model = write_random_gguf(tmp_path / "model.gguf", TINY, "Q4_0", weight_std=TINY_WEIGHT_STD)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ValueError, match=r"--weights-cache .* writable by others"):
        _load(model, shared)


def test_a_default_cache_that_cannot_be_made_leaves_the_stage_uncached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``auto`` under a home that cannot hold it (read-only, absent): the stage
    loads as without a cache; a directory the operator named is refused."""
    model = write_random_gguf(tmp_path / "model.gguf", TINY, "Q4_0", weight_std=TINY_WEIGHT_STD)
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    runner = _load(model, "auto")
    report = runner.model.describe()["weights_cache"]
    assert report["state"] == "failed" and str(blocker) in report["reason"]
    with pytest.raises(ValueError, match="--weights-cache"):
        _load(model, blocker / "cache")


def test_where_the_cache_is() -> None:
    assert cache_directory("off") is None
    assert cache_directory("auto", {"XDG_CACHE_HOME": "/x/y"}) == Path("/x/y/meshnet/weights")
    home = Path.home() / ".cache" / "meshnet" / "weights"
    assert cache_directory("auto", {}) == home
    assert cache_directory("auto", {"XDG_CACHE_HOME": "relative"}) == home  # the spec's rule
    assert cache_directory("/srv/cache") == Path("/srv/cache")


def test_off_and_dequantized_stages_have_no_cache(gguf_file: Path, tmp_path: Path) -> None:
    assert _load(gguf_file).model.describe()["weights_cache"] == {"state": "off"}
    dense = load_torch_runner(gguf_file, dtype="bfloat16", weights_cache=str(tmp_path))
    assert dense.model.describe()["weights_cache"] == {"state": "off"}
    assert not list(tmp_path.iterdir())


def test_a_load_gives_the_thread_count_back(gguf_file: Path) -> None:
    """The repack runs on one torch thread; the caller's count is restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        _load(gguf_file)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_a_writer_stopped_by_the_exit_leaves_no_file(
    gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At interpreter exit the writer stops at its next piece and is waited
    for (a daemon thread inside torch during its teardown aborted the node):
    its unnamed file goes with it, and the next start writes the file."""
    from meshnet_model.engines.torch import weight_cache

    monkeypatch.setattr(weight_cache, "_EXITING", threading.Event())
    weight_cache._EXITING.set()
    status = _load(gguf_file, tmp_path, SPANS[0]).model.weights.cache
    weight_cache._stop_writers()
    assert status.finished.is_set()
    assert (status.state, status.reason) == ("failed", "the process exited first")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(weight_cache, "_EXITING", threading.Event())
    assert _written(_load(gguf_file, tmp_path, SPANS[0])).exists()

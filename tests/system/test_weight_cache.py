"""``--weights-cache`` over real node processes: the first start of a quantized
GGUF stage writes its repacked weights, the second maps them (``/info`` and
its log say so) and answers with the same bytes; a cache directory that
others may write to is refused in one line, before anything listens."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from meshnet_model.testing.random_gguf import TINY, TINY_WEIGHT_STD, write_random_gguf
from support.gateway import clean_env, stop
from support.model_surface import ids_request, info, spawn_logged, wait_for
from support.security import send

pytestmark = pytest.mark.slow

IDS = np.array([[(13 * i + 7) % TINY["vocab_size"] for i in range(9)]], np.int32)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_gguf(tmp_path_factory.mktemp("cache-model") / "tiny-q4_0.gguf", TINY,
                             "Q4_0", seed=11, weight_std=TINY_WEIGHT_STD)  # fmt: skip


def _cache_state(url: str) -> dict:
    return info(url)["stage"]["weights_cache"]


def _logits(url: str) -> bytes:
    answer = send(url, ids_request(str(uuid.uuid4()), IDS))
    assert answer.status == 200, answer.raw[:400]
    assert len(answer.body) == 4 * TINY["vocab_size"]
    return answer.body


def test_the_second_start_maps_what_the_first_wrote(model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    flags = ["--model", str(model), "--engine", "torch", "--dtype", "keep",
             "--weights-cache", str(cache), "--log-level", "info"]  # fmt: skip
    first, url = spawn_logged("meshnet_node", flags, tmp_path / "first.log")
    try:
        assert _cache_state(url)["state"] in ("writing", "written")
        # The event: the writer's end, as /info reports it (bounded: a stuck
        # writer fails the test instead of hanging it).
        assert wait_for(lambda: _cache_state(url)["state"] == "written", bound=60)
        written = _cache_state(url)
        want = _logits(url)
    finally:
        assert stop(first) == 0
    path = Path(written["path"])
    assert path.parent == cache and path.stat().st_size == written["bytes"]
    assert cache.stat().st_mode & 0o777 == 0o700 and path.stat().st_mode & 0o777 == 0o600

    second, url = spawn_logged("meshnet_node", flags, tmp_path / "second.log")
    try:
        stage = info(url)["stage"]
        assert stage["weights_cache"] == {"state": "mapped", "path": str(path),
                                          "bytes": written["bytes"]}  # fmt: skip
        assert stage["weights_mapped_bytes"] > 0
        assert _logits(url) == want  # the same bytes as the stage repacked from the file
    finally:
        assert stop(second) == 0
    log = (tmp_path / "second.log").read_text()
    assert "weights cache: mapped" in log and str(path) in log, log[-2000:]
    assert "Traceback" not in log


def test_a_directory_others_may_write_to_is_one_line(model: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    done = subprocess.run(
        [sys.executable, "-m", "meshnet_node", "--port", "0", "--model", str(model),
         "--engine", "torch", "--weights-cache", str(shared)],
        capture_output=True, text=True, env=clean_env(), timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "listening" not in done.stdout and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("meshnet-node: ") and "--weights-cache" in last, done.stderr
    assert "writable by others" in last
    assert not list(shared.iterdir())

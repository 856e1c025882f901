"""The batching node's new surface as a user and a hostile peer meet it: real
``meshnet-node`` processes, loopback sockets (issue 19).

* its flags refuse bad values in one line, exit 2, before loading;
* a burst past ``--max-queued-tokens`` is answered 503 ``stage_busy`` with
  ``Retry-After`` and the spec's JSON body, before any work; the node stays
  up, the refused sessions hold nothing, and sent again they are answered
  with the very logits of a run alone;
* a bad chunk batched with good ones fails alone.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from meshnet_model.testing import small_config, write_checkpoint
from support.gateway import clean_env, spawn, stop
from support.security import Answer, get, metric, new_session, request, send, wire

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"), small_config(), seed=23)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--max-batch-tokens", "0"),
        ("--max-batch-tokens", "-3"),
        ("--max-batch-tokens", "1e3"),
        ("--max-queued-tokens", "0"),
        ("--max-queued-tokens", "lots"),
        ("--micro-batches", "0"),
        ("--micro-batches", "2000"),
        ("--micro-batches", "many"),
    ],
)
def test_a_bad_scheduler_flag_is_one_error_and_exit_2(
    checkpoint: Path, flag: str, value: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "meshnet_node", "--port", "0", "--model", str(checkpoint),
         flag, value],
        capture_output=True, text=True, timeout=60, env=clean_env(),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"meshnet-node: error: argument {flag}: "), done.stderr
    assert "Traceback" not in done.stderr


def ids(count: int, seed: int) -> np.ndarray:
    return ((np.arange(count, dtype=np.int32) * 7 + seed) % 256).reshape(1, count)


def chunk(session: str, tokens: np.ndarray) -> bytes:
    shape = f"1,{tokens.shape[1]}".encode()
    return request(wire(session, shape=shape, dtype=b"int32", position=0), tokens.tobytes())


_REFERENCE = """
import sys, numpy as np
from meshnet_model import StageRunner
runner = StageRunner.load(sys.argv[1])
given = np.load(sys.argv[2])
np.savez(sys.argv[3], **{name: runner.run(name, 0, given[name])[0] for name in given.files})
"""


def references(checkpoint: Path, runs: dict[str, np.ndarray], tmp: Path) -> dict[str, np.ndarray]:
    """Each run's logits from ``StageRunner`` alone, computed in a fresh
    interpreter as the node's are: a reference computed in this process
    sums with whatever BLAS state earlier tests left here (after torch and
    transformers ran in-process, 1 ulp off the node's, though both are right)."""
    given, out = tmp / "given.npz", tmp / "want.npz"
    np.savez(given, **runs)
    subprocess.run([sys.executable, "-c", _REFERENCE, str(checkpoint), str(given), str(out)],
                   check=True, timeout=300, env=clean_env())  # fmt: skip
    with np.load(out) as found:
        return {name: found[name] for name in found.files}


def logits(answer: Answer) -> np.ndarray:
    assert answer.status == 200, answer.body[:300]
    return np.frombuffer(answer.body, np.float32)


def test_a_burst_past_the_queue_is_503_stage_busy_and_loses_nothing(
    checkpoint: Path, tmp_path: Path
) -> None:
    found = references(checkpoint, {f"r{seed}": ids(200, seed) for seed in range(6)}, tmp_path)
    want = {seed: found[f"r{seed}"] for seed in range(6)}
    proc, url = spawn("meshnet_node", "--model", str(checkpoint), "--max-queued-tokens", "300")
    try:
        refused: list[tuple[str, int, Answer]] = []
        for _burst in range(5):  # until the burst overlapped at the node
            sessions = [(new_session(), seed) for seed in range(6)]
            with ThreadPoolExecutor(6) as pool:
                answers = list(pool.map(lambda s: send(url, chunk(s[0], ids(200, s[1]))),
                                        sessions))  # fmt: skip
            for (session, seed), answer in zip(sessions, answers, strict=True):
                if answer.status == 200:
                    assert np.array_equal(logits(answer), want[seed])
                else:
                    assert (answer.status, answer.code) == (503, "stage_busy"), answer.body
                    assert int(answer.headers[b"retry-after"]) >= 1
                    assert "max-queued-tokens" in answer.error["message"]
                    refused.append((session, seed, answer))
            if refused:
                break
        assert refused, "no burst ever queued past 300 rows"
        assert get(url, "/health").status == 200  # still up
        for session, seed, _ in refused:  # sent again: exactly the run alone
            assert np.array_equal(logits(send(url, chunk(session, ids(200, seed)))), want[seed])
        assert metric(url, "meshnet_stage_queued_rows") == 0
        assert metric(url, "meshnet_stage_steps_total") >= 1
    finally:
        assert stop(proc) == 0


def test_a_bad_chunk_batched_with_good_ones_fails_alone(checkpoint: Path, tmp_path: Path) -> None:
    want = references(checkpoint, {"good": ids(64, 2), "good2": ids(64, 3)}, tmp_path)
    proc, url = spawn("meshnet_node", "--model", str(checkpoint))
    try:
        bad = ids(64, 1)
        bad[0, 40] = 10**6  # past the vocabulary
        nan = np.full((1, 64), -5, np.int32)
        jobs = [("good", ids(64, 2)), ("bad", bad), ("negative", nan), ("good2", ids(64, 3))]
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(lambda j: send(url, chunk(new_session(), j[1])), jobs))
        by_name = dict(zip([name for name, _ in jobs], answers, strict=True))
        for name in ("bad", "negative"):
            assert (by_name[name].status, by_name[name].code) == (400, "bad_stage_input")
        for name in ("good", "good2"):
            assert np.array_equal(logits(by_name[name]), want[name])
        assert get(url, "/health").status == 200
    finally:
        assert stop(proc) == 0

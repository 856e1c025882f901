"""A draft model at the gateway (issue 38, ``--draft-model``; ``openai/draft_model.py``).

* Refused at start, one line and exit 2: a file that is not there or not a
  model, a vocabulary other than the served model's (naming the first id
  where the token strings differ and both sizes), a draft model beside
  ``--speculate off`` — by ``meshnet-gateway`` and by ``meshnet run``.
* ``ModelDrafter`` against greedy decoding of the same model, recomputed
  from scratch at every token: ``propose`` is that greedy walk, after
  ``extend`` by its own proposal too; after a ``rewind`` it proposes what a
  fresh drafter fed the kept ids proposes; it stops at a stop id; its
  session ends with ``close``, and one whose KV does not fit drafts nothing.
* The speculation loop drafting through it (a scripted chain, in process):
  the same tokens as plain decoding, the draft session gone when the
  generation ends — also when it is cancelled.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import uuid
from collections.abc import Collection, Iterable
from pathlib import Path

import anyio
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from meshnet_gateway.__main__ import main as gateway_main
from meshnet_gateway.openai.draft_model import (
    DRAFT_KV_CAP,
    DraftModel,
    ModelDrafter,
    draft_kv_budget,
    draft_model_problem,
)
from meshnet_gateway.openai.generation import ChainSession, generate
from meshnet_gateway.openai.metrics import GenerationMetrics
from meshnet_gateway.openai.output import GenerationResult
from meshnet_gateway.openai.speculation import Speculate
from meshnet_gateway.openai.tokenizer import ModelTokenizer
from meshnet_model.sampling import Sampler, SamplingParams
from meshnet_model.testing import random_weights, small_config
from meshnet_model.testing.gguf import GGUFVocab, write_gguf
from meshnet_runtime.codec_pool import CodecPool
from meshnet_runtime.downstream import DownstreamPool
from support.fake_verifier import FakeVerifier, ScriptModel, fake_verifier, scripted_settings
from support.gguf import CHAT_TEMPLATE, vocab_for
from support.openai import VOCAB, write_model_dir
from support.vocab import byte_level_vocab

PROMPT = [5, 300, 301, 302, 17, 42, 99, 250, 300, 301]
RENAMED = 300  # the id whose token the "renamed" vocabulary changes


def _write(path: Path, vocab: GGUFVocab, seed: int) -> Path:
    config = small_config(vocab_size=len(vocab.tokens), num_hidden_layers=2)
    document = config.to_dict()
    document["model_type"] = "llama"
    weights = random_weights(config, seed=seed)
    return write_gguf(
        path, document, weights, qtype="Q4_0", vocab=vocab, chat_template=CHAT_TEMPLATE
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft")
    vocab = vocab_for("llama")
    tokens = list(vocab.tokens)
    tokens[RENAMED] = "\u2581draftonly"
    return {
        "served": _write(root / "served.gguf", vocab, seed=1),
        "draft": _write(root / "draft.gguf", vocab, seed=2),  # the vocabulary, other weights
        "renamed": _write(root / "renamed.gguf", dataclasses.replace(vocab, tokens=tokens), 2),
        "other": _write(root / "other.gguf", byte_level_vocab(), seed=2),
    }


def _refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``meshnet-gateway argv``'s one line on stderr; it exits 2 before serving."""
    assert gateway_main(["--entry", "http://127.0.0.1:9", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_another_vocabulary_is_refused_naming_the_first_id_and_both_sizes(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    served = ModelTokenizer.load(files["served"])
    base = ["--model", str(files["served"]), "--draft-model"]
    line = _refusal([*base, str(files["renamed"])], capsys)
    original = served.tokenizer.id_to_token(RENAMED)
    size = served.vocab_size
    assert line == (
        f"meshnet-gateway: --draft-model {files['renamed']}: its vocabulary is not --model's: "
        f"id {RENAMED} is '\u2581draftonly' here and {original!r} there ({size} tokens here, "
        f"{size} there); a draft model must have the served model's tokenizer"
    )
    line = _refusal([*base, str(files["other"])], capsys)
    other = ModelTokenizer.load(files["other"])
    found = re.search(r"id (\d+) is .* \((\d+) tokens here, (\d+) there\)", line)
    assert found is not None, line
    first, here, there = map(int, found.groups())
    assert (here, there) == (other.vocab_size, size) and here != there
    token = other.tokenizer.id_to_token
    assert all(token(i) == served.tokenizer.id_to_token(i) for i in range(first))
    assert token(first) != served.tokenizer.id_to_token(first)
    # The same vocabulary, other weights: a draft model it takes.
    assert draft_model_problem(str(files["draft"]), served, "lookup") is None


def test_a_draft_model_it_cannot_use_is_refused_in_one_line(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--model", str(files["served"])]
    missing = tmp_path / "missing.gguf"
    assert _refusal([*base, "--draft-model", str(missing)], capsys).endswith(
        f"--draft-model {missing}: no such file (give a .gguf file with --model's tokenizer)"
    )
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all")
    assert f"--draft-model {garbage}: cannot load it: " in _refusal(
        [*base, "--draft-model", str(garbage)], capsys
    )
    off = [*base, "--speculate", "off", "--draft-model", str(files["draft"])]
    assert _refusal(off, capsys).endswith(
        "speculation is off (--speculate off); drop one of the two"
    )


def test_meshnet_run_refuses_it_before_anything_loads(files: dict[str, Path]) -> None:
    argv = [
        sys.executable,
        "-m",
        "meshnet_cli",
        "run",
        "--model",
        str(files["served"]),
        "--port",
        "0",
        "--draft-model",
        str(files["other"]),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"meshnet run: --draft-model {files['other']}: its vocabulary is not")


# -- the drafter against greedy decoding --------------------------------------------


@pytest.fixture(scope="module")
def draft(files: dict[str, Path]) -> DraftModel:
    size = len(vocab_for("llama").tokens)
    return DraftModel.load(str(files["draft"]), vocab=size, sessions=4, context=512)


def greedy(model: DraftModel, ids: list[int], count: int) -> list[int]:
    """``count`` greedy ids after ``ids``, each recomputed from scratch in a
    session of its own (no KV reused, no rewind)."""
    out: list[int] = []
    for _ in range(count):
        session = f"reference-{uuid.uuid4()}"
        logits = model.runner.run(session, 0, np.asarray([ids + out], dtype=np.int32))
        model.runner.end_session(session)
        out.append(int(np.argmax(logits[0, : model.vocab])))
    return out


def _drafter(model: DraftModel, ids: Iterable[int], stops: Collection[int] = ()) -> ModelDrafter:
    drafter = model.drafter(frozenset(stops))
    drafter.extend(ids)
    return drafter


@pytest.mark.anyio
async def test_propose_is_greedy_decoding_and_goes_on_after_its_own_proposal(
    draft: DraftModel,
) -> None:
    drafter = _drafter(draft, PROMPT)
    first = await drafter.propose(6)
    assert first == greedy(draft, PROMPT, 6)
    drafter.extend(first)  # a window sent: assumed accepted
    assert len(drafter) == len(PROMPT) + 6
    assert await drafter.propose(5) == greedy(draft, PROMPT + first, 5)
    drafter.close()
    assert (draft.runner.sessions, draft.runner.kv_bytes_in_use) == (0, 0)


@pytest.mark.anyio
@pytest.mark.parametrize("correction", [None, 7], ids=["rewound", "rewound-and-corrected"])
async def test_propose_after_rewind_is_what_a_fresh_drafter_proposes(
    draft: DraftModel, correction: int | None
) -> None:
    drafter = _drafter(draft, PROMPT)
    drafted = await drafter.propose(6)
    drafter.extend(drafted)
    await drafter.propose(4)  # the cache now holds positions past the history
    drafter.rewind(len(PROMPT) + 2)  # two drafts accepted
    kept = PROMPT + drafted[:2]
    assert draft.runner.cache_of(drafter.session).length == len(kept)
    if correction is not None:
        assert correction != drafted[2]
        drafter.extend([correction])
        kept.append(correction)
    fresh = _drafter(draft, kept)
    mine = await drafter.propose(6)
    assert mine == await fresh.propose(6) == greedy(draft, kept, 6)
    with pytest.raises(ValueError, match="cannot rewind"):
        drafter.rewind(len(drafter) + 1)
    drafter.close()
    fresh.close()
    assert draft.runner.sessions == 0


@pytest.mark.anyio
async def test_proposals_stop_at_a_stop_id(draft: DraftModel) -> None:
    walk = greedy(draft, PROMPT, 6)
    stop = next(t for t in walk if t not in PROMPT)
    drafter = _drafter(draft, PROMPT, stops={stop})
    proposed = await drafter.propose(6)
    assert proposed == walk[: walk.index(stop) + 1]  # the stop id is the last one
    drafter.extend(proposed)
    assert await drafter.propose(4) == []  # nothing follows a stop id
    drafter.close()


@pytest.mark.anyio
async def test_a_session_whose_kv_does_not_fit_drafts_nothing_and_lets_go(
    files: dict[str, Path],
) -> None:
    """A budget of 64 positions (one session of a 64-position context; the
    torch engine's cache grows 64 positions at a time): a 4-token prompt
    drafts, a 70-token one does not, and holds nothing."""
    model = DraftModel.load(str(files["draft"]), vocab=800, sessions=1, context=64)
    per_position = model.runner.budget.limit // 64
    assert model.runner.budget.limit == draft_kv_budget(per_position, sessions=1, context=64)
    want = greedy(model, PROMPT[:4], 2)  # its sessions end before the drafter's starts
    small = _drafter(model, PROMPT[:4])
    assert await small.propose(2) == want
    small.close()
    large = _drafter(model, PROMPT * 7)
    assert await large.propose(2) == []
    assert await large.propose(2) == []  # it stays off
    assert (model.runner.sessions, model.runner.kv_bytes_in_use) == (0, 0)
    large.rewind(3)  # the loop may still rewind it: nothing held, nothing to drop
    large.close()


def test_the_kv_budget_is_the_gateways_sessions_times_the_context_capped() -> None:
    assert draft_kv_budget(1000, sessions=4, context=100) == 400_000
    assert draft_kv_budget(46_080, sessions=128, context=8192) == DRAFT_KV_CAP
    assert draft_kv_budget(1000, sessions=1, context=0) == 1000  # room for one position


# -- the speculation loop drafting through a drafter -------------------------------

PATTERN = list(range(40, 60))
LOOP_PROMPT = PATTERN * 2
GREEDY = SamplingParams(temperature=0.0)


class Oracle:
    """A drafter that knows the scripted chain's greedy walk; each proposal
    is computed in a worker thread, as a draft model's is."""

    def __init__(self, script: ScriptModel) -> None:
        self.script = script
        self.ids: list[int] = []
        self.closed = False
        self.proposals = 0

    def __len__(self) -> int:
        return len(self.ids)

    def extend(self, ids: Iterable[int]) -> None:
        self.ids.extend(ids)

    def rewind(self, length: int) -> None:
        del self.ids[length:]

    def _walk(self, k: int) -> list[int]:
        held = list(self.ids)
        for _ in range(k):
            held.append(int(np.argmax(self.script.row(held))))
        return held[len(self.ids) :]

    async def propose(self, k: int) -> list[int]:
        self.proposals += 1
        return await anyio.to_thread.run_sync(self._walk, k)

    def close(self) -> None:
        self.closed = True


class OracleModel:
    """What ``Speculate(model=...)`` asks of a draft model: a drafter each generation."""

    def __init__(self, script: ScriptModel) -> None:
        self.script = script
        self.made: list[Oracle] = []

    def drafter(self, stop_ids: frozenset[int]) -> Oracle:
        self.made.append(Oracle(self.script))
        return self.made[-1]


async def _generate(
    script: ScriptModel,
    tokenizer: ModelTokenizer,
    speculate: Speculate | None,
    cancel_after: int | None = None,
    **kw: object,
) -> tuple[GenerationResult | None, ChainSession]:
    """The generation over a scripted chain; ``cancel_after``: cancelled as
    that many tokens are taken (the client left; None as its result)."""
    settings = scripted_settings(speculate)
    taken, result = 0, None

    def on_token() -> None:
        nonlocal taken
        taken += 1
        if taken == cancel_after:
            scope.cancel()

    async with fake_verifier(FakeVerifier(script)) as url:
        pool = DownstreamPool(url)
        chain = ChainSession(
            pool, CodecPool(), settings, metrics=GenerationMetrics(CollectorRegistry())
        )
        try:
            with anyio.CancelScope() as scope:  # the chain's end (DELETE) outside it
                result = await generate(
                    chain,
                    tokenizer,
                    LOOP_PROMPT,
                    sampler=Sampler(GREEDY, 7),
                    speculate=speculate,
                    on_token=on_token,
                    **kw,
                )
        finally:
            await chain.close()
            await pool.aclose()
    assert scope.cancelled_caught == (cancel_after is not None)
    return result, chain


@pytest.fixture(scope="module")
def loop_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("loop") / "m")


@pytest.mark.anyio
async def test_the_loop_awaits_the_drafter_and_answers_the_plain_tokens(loop_files: Path) -> None:
    tokenizer = ModelTokenizer.load(loop_files)
    script = ScriptModel(PATTERN, VOCAB)
    plain, _ = await _generate(script, tokenizer, None, max_tokens=30)
    oracle = OracleModel(script)
    mine, chain = await _generate(script, tokenizer, Speculate(6, 2, model=oracle), max_tokens=30)
    assert mine.token_ids == plain.token_ids and mine.text == plain.text
    (drafter,) = oracle.made
    assert drafter.closed and drafter.proposals > 1
    assert chain.drafted > 0 and chain.accepted == chain.drafted  # it knows the walk
    # A real draft model (this tokenizer's random checkpoint, numpy): other
    # drafts, the same answer, and no session left when it ends.
    model = DraftModel.load(str(loop_files), vocab=VOCAB, sessions=2, context=256)
    real, chain = await _generate(script, tokenizer, Speculate(6, 2, model=model), max_tokens=30)
    assert real.token_ids == plain.token_ids and chain.drafted > 0
    assert (model.runner.sessions, model.runner.kv_bytes_in_use) == (0, 0)


@pytest.mark.anyio
async def test_a_cancelled_generation_closes_its_drafter(loop_files: Path) -> None:
    tokenizer = ModelTokenizer.load(loop_files)
    oracle = OracleModel(ScriptModel(PATTERN, VOCAB))
    speculate = Speculate(6, 2, model=oracle)
    result, chain = await _generate(
        oracle.script, tokenizer, speculate, cancel_after=12, max_tokens=200
    )
    assert result is None and chain.drafted > 0  # cancelled mid-way, windows were sent
    (drafter,) = oracle.made
    assert drafter.closed

"""Many clients, one chain (issue 37), over real processes: API keys apart
from the chain's token, a prefix cache kept per tenant, quotas counted by
the real client.

One chain — two model nodes and a gateway — on the chain's token, the
gateway with an ``--api-keys`` file of five tenants (``carol`` and ``dave``
in the cache group ``public``). Each scenario is one the issue measured on
the tree before it, where the API key *was* the chain's token: there the
poisoning changed the victim's answer, a right guess of another client's
prompt attached its cached prefix (and the metrics said so), and one
client's sessions locked every other out. Here each fails.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from meshnet_proto.lowlevel import key_digest, prefix_block_keys
from support.model_surface import ModelChain, model_chain, wait_for, write_model
from support.security import Answer, get, request, send, wire

TOKEN = "chain-" + "5e" * 24
KEYS = {name: f"mk-{name}-" + "7a" * 20 for name in ("alice", "bob", "mallory", "carol", "dave")}
GROUPS = {"carol": "public", "dave": "public"}
# The PIN in alice's system prompt: ~80 tokens of the test tokenizer, two
# whole prefix blocks and more.
SECRET = "system: you are the bank's assistant. the customer's pin is 4821. " * 3
REFUND = "the refund window for an unopened item is fourteen days. question: how long? answer:"


def _key_file(path: Path, keys: dict[str, str]) -> Path:
    lines = []
    for tenant, key in keys.items():
        group = GROUPS.get(tenant)
        lines.append(f"{tenant} sha256:{key_digest(key)}" + (f" cache={group}" if group else ""))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelChain]:
    root = tmp_path_factory.mktemp("tenants")
    model_dir = write_model(root / "model")
    keys = _key_file(root / "keys.txt", KEYS)
    node = ["--token", TOKEN, "--max-sessions", "16"]
    gateway = [*node, "--api-keys", str(keys), "--max-sessions", "32"]
    with model_chain(model_dir, root, node_flags=node, gateway_flags=gateway) as running:
        running.keys_file = keys  # type: ignore[attr-defined]
        yield running


def _post(url: str, path: str, body: dict, key: str | None) -> Answer:
    data = json.dumps(body).encode()
    pairs = [(b"Content-Type", b"application/json")]
    raw = request(pairs, data, target=path.encode(), token=key)
    return send(url, raw, timeout=120.0, half_close=False)


def _complete(chain: ModelChain, tenant: str, prompt: str, **extra: str) -> str:
    body = {"model": chain.model, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    answer = _post(chain.gateway, "/v1/completions", body, KEYS[tenant])
    assert answer.status == 200, answer.raw[:400]
    return json.loads(answer.body)["choices"][0]["text"]


def _code(answer: Answer) -> str:
    return json.loads(answer.body)["error"]["code"]


def _hits(chain: ModelChain) -> list[int]:
    """Each stage's prefix-cache hits, as the operator (the chain's token) reads them."""
    hits = []
    for url in chain.nodes:
        answer = get(url, "/info", token=TOKEN)
        assert answer.status == 200, answer.raw[:300]
        hits.append(json.loads(answer.body)["stage"]["prefix_cache"]["hits"])
    return hits


# ------------------------------------------------------------- credentials


def test_a_key_opens_the_client_paths_of_the_gateway_only(chain: ModelChain) -> None:
    key = KEYS["alice"]
    assert get(chain.gateway, "/v1/models", token=key).status == 200
    for target in ("/info", "/metrics", "/health?deep=1"):
        answer = get(chain.gateway, target, token=key)
        assert (answer.status, _code(answer)) == (403, "key_not_allowed"), target
        assert get(chain.gateway, target, token=TOKEN).status == 200, target
    for credential in (None, "mk-nobody", key.upper()):
        answer = get(chain.gateway, "/v1/models", token=credential)
        assert (answer.status, _code(answer)) == (401, "unauthorized")
    # A node serves its chain: a client's key opens nothing there.
    for url in chain.nodes:
        for target in ("/info", "/metrics"):
            assert get(url, target, token=key).status == 401
        answer = send(url, request(wire(str(uuid.uuid4()), shape=b"1,2", dtype=b"int32"),
                                   np.asarray([1, 2], "<i4").tobytes(), token=key))  # fmt: skip
        assert (answer.status, _code(answer)) == (401, "unauthorized")


def test_a_page_on_an_allowed_origin_gets_its_preflight_without_a_key(
    chain: ModelChain,
) -> None:
    """Browsers send no credential on a CORS preflight: a gateway with API keys
    answers it (204) for an origin it allows, and the real request needs the key."""
    origin = b"http://localhost:3000"
    pairs = [
        (b"Origin", origin),
        (b"Access-Control-Request-Method", b"POST"),
        (b"Access-Control-Request-Headers", b"authorization, content-type"),
    ]
    raw = request(pairs, b"", method=b"OPTIONS", target=b"/v1/chat/completions", length=None)
    answer = send(chain.gateway, raw)
    assert answer.status == 204, answer.raw[:300]
    assert answer.headers[b"access-control-allow-origin"] == origin
    page = request([(b"Origin", origin)], b"", method=b"GET", target=b"/v1/models", length=None)
    assert send(chain.gateway, page).status == 401


def test_keys_are_added_and_revoked_without_a_restart(chain: ModelChain) -> None:
    keys_file: Path = chain.keys_file  # type: ignore[attr-defined]
    erin = "mk-erin-" + "3c" * 20
    assert get(chain.gateway, "/v1/models", token=erin).status == 401
    _key_file(keys_file, {**KEYS, "erin": erin})
    assert wait_for(lambda: get(chain.gateway, "/v1/models", token=erin).status == 200, bound=10)
    _key_file(keys_file, KEYS)
    assert wait_for(lambda: get(chain.gateway, "/v1/models", token=erin).status == 401, bound=10)
    assert get(chain.gateway, "/v1/models", token=KEYS["bob"]).status == 200


# ------------------------------------------------------------- poisoning


def test_another_clients_kv_cannot_be_filed_under_a_victims_prompt(chain: ModelChain) -> None:
    """The issue's attack, step by step, with what a client now holds (its
    key): the first stage's hidden states of other text, filed at the second
    stage under the block keys of the victim's prompt. Each step is refused
    at the nodes; through the gateway the forged headers are not passed on;
    the victim's answer stays its reference."""
    reference = _complete(chain, "bob", REFUND)
    ids = list(range(3, 3 + 64))
    victim_keys = prefix_block_keys(ids)  # what the tree before named bob's blocks
    session = str(uuid.uuid4())
    # 1. hidden states of the attacker's text from the first stage (?replay=1)
    steal = request(wire(session, shape=b"1,64", dtype=b"int32"),
                    np.asarray(ids, "<i4").tobytes(), target=b"/forward?replay=1",
                    token=KEYS["mallory"])  # fmt: skip
    assert send(chain.nodes[0], steal).status == 401
    # 2. filed at the second stage under the victim's keys
    hidden = np.full((1, 64, 64), 0.5, "<f4")
    pairs = wire(str(uuid.uuid4()), shape=b"1,64,64", dtype=b"float32")
    pairs.append((b"X-Meshnet-Prefix-Blocks", ",".join(victim_keys).encode()))
    answer = send(chain.nodes[1], request(pairs, hidden.tobytes(), token=KEYS["mallory"]))
    assert (answer.status, _code(answer)) == (401, "unauthorized")
    # 3. the same headers through the gateway's /forward: served as mallory's
    # own session, the forged keys dropped (the gateway names every block).
    pairs = wire(None, shape=b"1,64", dtype=b"int32", index=None, total=None)
    pairs.append((b"X-Meshnet-Prefix-Blocks", ",".join(victim_keys).encode()))
    pairs.append((b"X-Meshnet-Cache-Salt", b"00" * 16))
    pairs.append((b"X-Meshnet-Client", _client_of_bob()))
    raw = request(pairs, np.asarray(ids, "<i4").tobytes(), token=KEYS["mallory"])
    assert send(chain.gateway, raw).status == 200
    assert _complete(chain, "bob", REFUND) == reference


def _client_of_bob() -> bytes:
    from meshnet_gateway.tenancy import tenancy_of

    return tenancy_of("bob", None, None).client.encode()


# ------------------------------------------------------------- the PIN search


def test_a_prefix_is_shared_within_a_tenant_and_never_across(chain: ModelChain) -> None:
    _complete(chain, "alice", SECRET + "what is my balance?")
    before = _hits(chain)
    # mallory guesses the PIN right: her prompt is alice's to the byte, and
    # nothing she can read says so — no cache hit (so no time saved), and
    # the gateway's counters are not hers to read.
    _complete(chain, "mallory", SECRET + "what is my balance?")
    assert _hits(chain) == before
    metrics = get(chain.gateway, "/metrics", token=KEYS["mallory"])
    assert (metrics.status, _code(metrics)) == (403, "key_not_allowed")
    # alice asking again attaches her own prefix on every stage
    _complete(chain, "alice", SECRET + "what is my balance?")
    assert _hits(chain) == [h + 1 for h in before]
    # The gateway's access log names the tenant of each request (not its key).
    log = chain.logs["gateway"].read_text()
    assert "tenant=alice" in log and "tenant=mallory" in log and KEYS["alice"] not in log


def test_tenants_of_one_cache_group_share_their_prefixes(chain: ModelChain) -> None:
    shared = "system: a public assistant prompt, the same for every customer. " * 3
    _complete(chain, "carol", shared + "hello")
    before = _hits(chain)
    _complete(chain, "dave", shared + "hello")  # same group: dave attaches carol's prefix
    after_dave = _hits(chain)
    _complete(chain, "alice", shared + "hello")  # no group: alice does not
    assert after_dave == [h + 1 for h in before]
    assert _hits(chain) == after_dave


def test_a_requests_cache_salt_narrows_sharing_within_its_tenant(chain: ModelChain) -> None:
    prompt = "user notes, private to one conversation of the tenant. " * 3
    _complete(chain, "bob", prompt, cache_salt="conversation-1")
    before = _hits(chain)
    _complete(chain, "bob", prompt, cache_salt="conversation-2")
    _complete(chain, "bob", prompt)
    assert _hits(chain) == before
    _complete(chain, "bob", prompt, cache_salt="conversation-1")
    assert _hits(chain) == [h + 1 for h in before]
    for salt, code in ((7, "invalid_type"), ("\ud800", "invalid_unicode")):
        body = {"model": chain.model, "prompt": "x", "cache_salt": salt}
        answer = _post(chain.gateway, "/v1/completions", body, KEYS["bob"])
        error = json.loads(answer.body)["error"]
        assert (answer.status, error["param"], error["code"]) == (400, "cache_salt", code)


# ------------------------------------------------------------- quotas


def test_one_tenant_filling_its_session_quota_leaves_the_others_served(
    chain: ModelChain,
) -> None:
    """A node's per-client quota (half its 16 sessions) counts the tenant the
    gateway names, not the gateway's address: mallory's one-token sessions
    fill hers alone."""
    ids = np.asarray([[5]], "<i4").tobytes()

    def forward(tenant: str) -> Answer:
        pairs = wire(None, shape=b"1,1", dtype=b"int32", index=None, total=None)
        return send(chain.gateway, request(pairs, ids, token=KEYS[tenant]))

    answers = []
    for _ in range(12):  # at most 8 fit (an earlier test may hold one already)
        answers.append(forward("mallory"))
        if answers[-1].status != 200:
            break
    last = answers[-1]
    assert (last.status, _code(last)) == (429, "client_sessions_full"), last.raw[:300]
    assert 7 <= len(answers) - 1 <= 8
    # bob is served, on /v1 and /forward alike
    _complete(chain, "bob", "hello world")
    assert forward("bob").status == 200

"""Every client command reads the same environment (issue 43, point 6):
``MESHNET_TOKEN`` reached ``generate`` and ``send`` but not ``status`` and
``conformance``, and ``status`` then answered a gateway's 401 with "is a
gateway listening there?"."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshnet_cli.__main__ import build_parser
from support.gateway import clean_env, process_chain

LIMIT = 120  # seconds: only ends a hung command


@pytest.mark.parametrize(
    "argv",
    [
        ["send", "in.npy", "out.npy"],
        ["generate", "--prompt", "hi"],
        ["status"],
        ["conformance", "http://127.0.0.1:1"],
    ],
)
def test_every_client_command_takes_the_token_and_gateway_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    monkeypatch.setenv("MESHNET_TOKEN", "from-env")
    monkeypatch.setenv("MESHNET_GATEWAY", "http://gateway.example:8100")
    args = build_parser().parse_args(argv)
    assert args.token == "from-env"
    where = getattr(args, "gateway", None) or args.url
    assert where in ("http://gateway.example:8100", "http://127.0.0.1:1")
    assert build_parser().parse_args([*argv, "--token", "flag"]).token == "flag"  # a flag wins


def status(url: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshnet_cli", "status", url],
        capture_output=True,
        text=True,
        timeout=LIMIT,
        env={**clean_env(), **(env or {})},
    )


@pytest.mark.slow
def test_status_says_401_and_reads_meshnet_token() -> None:
    with process_chain(1, gateway_flags=["--token", "s3cret"]) as (_, gateway, _procs):
        without = status(gateway)
        wrong = status(gateway, {"MESHNET_TOKEN": "nope"})
        right = status(gateway, {"MESHNET_TOKEN": "s3cret"})
    assert without.returncode == 2
    assert without.stderr == (
        f"meshnet status: {gateway}: 401 on /info: the server requires a bearer token: "
        "give --token or set MESHNET_TOKEN\n"
    )
    assert "listening" not in without.stderr
    assert wrong.returncode == 2 and "is not the server's" in wrong.stderr, wrong.stderr
    assert right.returncode == 0, right.stderr
    assert right.stdout.startswith("gateway  entry "), right.stdout

"""A gateway's API key file (meshnet_runtime.credentials), the flags that
bring it in, and ``meshnet keys``: parsed strictly, re-read when it changes,
a bad edit never locking the clients out."""

from __future__ import annotations

import io
import os
from pathlib import Path

import anyio
import pytest

from meshnet_cli.__main__ import main as meshnet_main
from meshnet_gateway.config import GatewayConfig
from meshnet_node.config import NodeConfig
from meshnet_proto import ProtocolError
from meshnet_proto.lowlevel import Credentials, key_digest
from meshnet_runtime.credentials import (
    ApiKeyFile,
    KeyFileError,
    chain_credentials,
    parse_key_file,
    watch_key_file,
)
from support.waiting import wait_until

A = key_digest("mk-a")
B = key_digest("mk-b")


def _tenant(credentials: Credentials, key: str) -> str | None:
    return credentials.identify(
        [(b"authorization", b"Bearer " + key.encode())], "/forward", ""
    ).tenant


def test_a_key_file_parses_with_comments_groups_and_blank_lines() -> None:
    text = f"# keys\n\nacme sha256:{A}   # the first\nwidgets  sha256:{B} cache=public\n"
    lines = parse_key_file(text)
    assert [(x.tenant, x.digest, x.cache_group) for x in lines] == [
        ("acme", A, None),
        ("widgets", B, "public"),
    ]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("acme", "expected 'TENANT sha256:DIGEST"),
        (f"acme sha256:{A} cache=x extra", "expected"),
        (f"bad/name sha256:{A}", "tenant name"),
        ("acme mk-plaintext-key", "sha256:<64"),
        (f"acme sha256:{A.upper()}", "sha256:<64"),
        (f"acme sha256:{A} group=x", "the only option"),
        (f"acme sha256:{A}\nother sha256:{A}", "listed already"),
        (f"acme sha256:{A}\nacme sha256:{B} cache=g", "another cache group"),
    ],
)
def test_a_bad_line_is_named_by_its_number_and_never_quoted(text: str, needle: str) -> None:
    with pytest.raises(KeyFileError) as caught:
        parse_key_file(text, "keys.txt")
    message = str(caught.value)
    assert needle in message and message.startswith("keys.txt:")
    assert "mk-plaintext-key" not in message


def test_the_file_is_reloaded_when_it_changes_and_a_bad_edit_keeps_the_keys(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys"
    path.write_text(f"acme sha256:{A}\n")
    credentials = Credentials(["chain-token"])
    keys = ApiKeyFile(str(path), credentials)
    assert _tenant(credentials, "mk-a") == "acme" and not keys.refresh()
    path.write_text(f"widgets sha256:{B} cache=public\n")
    os.utime(path, ns=(1, 10**18))  # a change the stat sees, whatever the clock's grain
    assert keys.refresh() and keys.cache_groups == {"widgets": "public"}
    assert _tenant(credentials, "mk-b") == "widgets"
    with pytest.raises(ProtocolError):
        _tenant(credentials, "mk-a")  # revoked
    path.write_text("half written lin")
    os.utime(path, ns=(1, 2 * 10**18))
    assert not keys.refresh() and not keys.refresh()  # logged once, the keys kept
    assert _tenant(credentials, "mk-b") == "widgets"
    assert sum("API keys not reloaded" in r.message for r in caplog.records) == 1
    path.unlink()
    assert not keys.refresh()
    assert _tenant(credentials, "mk-b") == "widgets"


def test_a_file_too_large_or_not_text_or_absent_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.write_bytes(b"#" * (4 * 1024 * 1024 + 1))
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00")
    for path, needle in ((big, "larger than"), (binary, "UTF-8"), (tmp_path / "none", "No such")):
        with pytest.raises(KeyFileError, match=needle):
            ApiKeyFile(str(path), Credentials())


def test_the_watcher_reloads_within_its_interval(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"acme sha256:{A}\n")
    credentials = Credentials(["t"])
    keys = ApiKeyFile(str(path), credentials)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_key_file, keys, 0.01)
            path.write_text(f"acme sha256:{A}\nwidgets sha256:{B}\n")
            await wait_until(lambda: "widgets" in credentials.tenants, "the file re-read")
            tg.cancel_scope.cancel()

    anyio.run(main)


def test_chain_credentials_take_the_token_and_the_rotation_one() -> None:
    node = NodeConfig.load(["--token", "new", "--accept-token", "old"], {})
    credentials = chain_credentials(node)
    for token in ("new", "old"):
        assert credentials.identify(
            [(b"authorization", f"Bearer {token}".encode())], "/info", ""
        ).chain
    assert "new" not in repr(node) and "old" not in repr(node)
    assert not chain_credentials(NodeConfig.load([], {})).required


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--accept-token", "x"], "--accept-token is a second chain token"),
        (["--api-keys", "KEYS"], "give the chain's token too"),
        (["--api-keys", "MISSING", "--token", "t"], "--api-keys: "),
        (["--api-keys", "BAD", "--token", "t"], "--api-keys: "),
    ],
)
def test_flags_that_cannot_work_are_one_line_and_exit_2(
    argv: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "KEYS").write_text(f"acme sha256:{A}\n")
    (tmp_path / "BAD").write_text("acme mk-a\n")
    argv = [str(tmp_path / a) if a in ("KEYS", "MISSING", "BAD") else a for a in argv]
    with pytest.raises(SystemExit) as exc:
        GatewayConfig.load(["--entry", "http://127.0.0.1:1", *argv], {})
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_the_gateway_reads_its_key_file_from_the_environment(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text(f"acme sha256:{A}\n")
    env = {"MESHNET_API_KEYS": str(tmp_path / "keys"), "MESHNET_TOKEN": "t"}
    config = GatewayConfig.load(["--entry", "http://127.0.0.1:1"], env)
    assert config.api_keys == str(tmp_path / "keys")


def test_meshnet_keys_new_prints_the_key_once_and_files_its_digest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys"
    assert meshnet_main(["keys", "new", "acme", "--file", str(path)]) == 0
    key = capsys.readouterr().out.strip()
    assert meshnet_main(["keys", "new", "pub", "--file", str(path), "--cache-group", "g"]) == 0
    other = capsys.readouterr().out.strip()
    text = path.read_text()
    assert key.startswith("mk-") and key not in text and other not in text
    assert text == f"acme sha256:{key_digest(key)}\npub sha256:{key_digest(other)} cache=g\n"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    credentials = Credentials(["t"])
    ApiKeyFile(str(path), credentials)
    assert _tenant(credentials, key) == "acme"


def test_meshnet_keys_refuses_a_bad_file_and_digests_stdin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "bad"
    bad.write_text("acme mk-a")  # no newline, and not a digest
    assert meshnet_main(["keys", "new", "acme", "--file", str(bad)]) == 2
    assert "sha256:<64" in capsys.readouterr().err and bad.read_text() == "acme mk-a"
    ok = tmp_path / "ok"
    ok.write_text(f"acme sha256:{A}")  # no trailing newline: one is added first
    assert meshnet_main(["keys", "new", "bob", "--file", str(ok)]) == 0
    assert len(parse_key_file(ok.read_text())) == 2
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO("mk-a\n"))
    assert meshnet_main(["keys", "digest", "acme"]) == 0
    assert capsys.readouterr().out == f"acme sha256:{A}\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert meshnet_main(["keys", "digest", "acme"]) == 2

"""The flags every server takes, and the one mechanism behind them (wire-2 §9).

Every server takes the common flags (listening, timeouts and limits, access,
codecs, replica sets); a role adds its own by subclassing :class:`ServerConfig`
beside its server: ``meshnet_node.config.NodeConfig`` (``--next``,
``--backend``, ``--model``, …) and ``meshnet_gateway.config.GatewayConfig``
(``--entry``, ``--chunk-tokens``, ``--retries``, …). Precedence is flag >
environment > default. An environment value goes through the same validation
as the flag, and a bad one names the variable.

One source of truth: a default is written once, where it is used — the
core's ``Limits`` for what the core enforces, the serving loop's
``ServerSettings`` for its timeouts and caps, a role's config class for its
own. A config class's fields are the defaults, its flag table (and so
``--help`` and the environment) names those fields, and ``/info`` shows
``limits_info()``.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, NamedTuple, NoReturn, Self

from meshnet_proto import Limits

from .endpoints import Endpoint, parse_endpoint
from .http_server import ServerSettings

__all__ = [
    "COMMON_FLAGS",
    "ENCODINGS",
    "LOG_LEVELS",
    "WIRE_DTYPES",
    "Flag",
    "OneLineParser",
    "ServerConfig",
    "add_flags",
    "model_path_problem",
    "choice",
    "endpoint_list",
    "env_name",
    "millis",
    "nonempty",
    "nonnegative_int",
    "positive_int",
    "positive_seconds",
    "split_replicas",
]

WIRE_DTYPES = ("keep", "float32", "bfloat16", "float16", "auto-lossless")
ENCODINGS = ("mirror", "identity", "zstd", "auto")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

_LIMITS = Limits()  # the core's defaults
_SETTINGS = ServerSettings()  # the serving loop's defaults


class Flag(NamedTuple):
    """One row of a flag table: its default is the config field of its name."""

    name: str  # "--chunk-tokens": field chunk_tokens, environment MESHNET_CHUNK_TOKENS
    kind: Callable[[str], Any]  # text -> value; raises argparse.ArgumentTypeError
    help: str

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    @property
    def env(self) -> str:
        return env_name(self.name)


def env_name(flag: str) -> str:
    """``--chunk-tokens`` → ``MESHNET_CHUNK_TOKENS``."""
    return "MESHNET_" + flag.lstrip("-").upper().replace("-", "_")


class OneLineParser(argparse.ArgumentParser):
    """A parser whose refusal is one line on stderr, exit 2: the cause, then
    where the fix is documented — not the 25-line usage block first, which
    pushed the one line that mattered off a terminal's screen."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# -- the parsers of flag values --------------------------------------------------------


def positive_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def nonnegative_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def _port(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0-65535, got {text!r}")
    return int(text)


def _level(text: str) -> int:
    # zstd's own range; negative levels are its "fast" modes.
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not -7 <= value <= 22:
        raise argparse.ArgumentTypeError(f"zstd level must be -7..22, got {value}")
    return value


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _at_least_zero(text: str, unit: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {unit}, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected {unit} >= 0, got {text!r}")
    return value


def millis(text: str) -> float:
    return _at_least_zero(text, "milliseconds")


def seconds_or_zero(text: str) -> float:
    return _at_least_zero(text, "seconds")


def _endpoint(text: str) -> Endpoint:
    try:
        return parse_endpoint(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def endpoint_list(text: str) -> tuple[Endpoint, ...]:
    """``URL[,URL...]``: one hop's replica set."""
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"an empty URL in {text[:200]!r}")
    return tuple(_endpoint(part) for part in parts)


def nonempty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def choice(choices: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(
                f"invalid choice {text!r} (choose from {', '.join(choices)})"
            )
        return text

    parse.choices = tuple(choices)  # type: ignore[attr-defined]  # shown by --help
    return parse


# -- the flags every server takes ------------------------------------------------------

_LISTEN = (
    Flag("--host", nonempty, "address to listen on"),
    Flag("--port", _port, "TCP port (0 = a free one, shown in the ready line)"),
    Flag("--uds", nonempty, "listen on this Unix socket path instead of TCP"),
)
_LIMIT = (
    Flag("--timeout", positive_seconds, "budget of one request, seconds"),
    Flag("--max-sessions", positive_int, "sessions held at once"),
    Flag(
        "--max-sessions-per-client",
        nonnegative_int,
        "sessions one client address may hold (None: half of --max-sessions; 0: no quota)",
    ),
    Flag("--session-ttl", positive_seconds, "idle seconds before a session is forgotten"),
    Flag("--reorder-window", positive_int, "chunks a session may run ahead"),
    Flag("--reorder-timeout", positive_seconds, "seconds a chunk waits for its predecessor"),
    Flag("--head-timeout", positive_seconds, "seconds a client has to send its request head"),
    Flag("--max-tensor-bytes", positive_int, "largest tensor accepted"),
    Flag("--max-stored-bytes", positive_int, "answers kept for replay, all sessions together"),
    Flag(
        "--max-inflight-bytes",
        positive_int,
        "tensor bytes held for requests in flight, all together (more get 503)",
    ),
    Flag("--max-connections", positive_int, "concurrent connections (more get 503)"),
    Flag("--shutdown-timeout", positive_seconds, "seconds in-flight requests get on shutdown"),
)
_ACCESS = (
    Flag(
        "--token",
        nonempty,
        "the chain's token: require 'Authorization: Bearer TOKEN' (and present it)",
    ),
    Flag(
        "--accept-token",
        nonempty,
        "a second chain token this server accepts (the old one, during a rotation)",
    ),
    Flag("--tls-cert", nonempty, "serve TLS with this PEM certificate chain"),
    Flag("--tls-key", nonempty, "... and this PEM private key"),
    Flag("--tls-ca", nonempty, "verify an https downstream with this CA bundle"),
    Flag("--log-level", choice(LOG_LEVELS), "logging level"),
)
_CODECS = (
    Flag("--wire-dtype", choice(WIRE_DTYPES), "dtype of tensors this server sends"),
    Flag("--encoding", choice(ENCODINGS), "encoding of bodies this server sends"),
    Flag("--zstd-level", _level, "zstd compression level"),
    Flag("--async-backend", choice(("trio", "asyncio")), "event loop to run on"),
)
_REPLICAS = (
    Flag("--health-interval", positive_seconds, "seconds between health probes of each replica"),
    Flag("--probe-timeout", positive_seconds, "a replica not answering a probe this long is down"),
    Flag("--max-history-bytes", positive_int, "chunks kept per hop to replay on failover, in all"),
)
COMMON_FLAGS: tuple[Flag, ...] = _LISTEN + _LIMIT + _ACCESS + _CODECS + _REPLICAS


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """Validated settings every server has; a role's subclass adds its own.

    A subclass names its role (``role``: the program ``meshnet-<role>``) and
    its flags (``ROLE_FLAGS``, a field for each), and may check flags that go
    together in ``check_role`` — the table is then the one source of the
    role's ``--help``, environment and defaults.
    """

    role: ClassVar[str] = "server"
    ROLE_FLAGS: ClassVar[tuple[Flag, ...]] = ()

    host: str = "127.0.0.1"
    port: int = 0
    uds: str | None = None
    timeout: float = _SETTINGS.body_timeout
    max_sessions: int = _LIMITS.max_sessions
    # None: half of max_sessions (the core's rule, Limits); 0: no quota.
    max_sessions_per_client: int | None = None
    session_ttl: float = _LIMITS.session_ttl
    reorder_window: int = _LIMITS.reorder_window
    reorder_timeout: float = _LIMITS.reorder_timeout
    head_timeout: float = _SETTINGS.head_timeout
    max_tensor_bytes: int = _LIMITS.max_tensor_bytes
    max_stored_bytes: int = _LIMITS.max_stored_bytes
    max_inflight_bytes: int = _LIMITS.max_inflight_bytes
    max_connections: int = _SETTINGS.max_connections
    shutdown_timeout: float = _SETTINGS.shutdown_timeout
    token: str | None = field(default=None, repr=False)  # never logged
    # wire-2 §7: a rotation's old (or next) token, accepted but never presented.
    accept_token: str | None = field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    log_level: str = "info"
    wire_dtype: str = "keep"
    encoding: str = "mirror"
    zstd_level: int = 1
    async_backend: str = "trio"
    # replica sets (docs/failover.md): --next/--entry may name several URLs
    # or a host name whose every address is a replica.
    health_interval: float = 2.0  # seconds between health probes of a replica
    probe_timeout: float = 2.0  # a probe unanswered this long marks a replica down
    max_history_bytes: int = 256 * 1024 * 1024  # what a hop keeps to replay, all sessions

    # The core's limits, built (and so validated) once, with the config.
    limits: Limits = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        limits = Limits(
            max_tensor_bytes=self.max_tensor_bytes,
            max_stored_bytes=self.max_stored_bytes,
            max_inflight_bytes=self.max_inflight_bytes,
            max_sessions=self.max_sessions,
            max_sessions_per_client=self.max_sessions_per_client,
            session_ttl=self.session_ttl,
            reorder_window=self.reorder_window,
            reorder_timeout=self.reorder_timeout,
        )
        object.__setattr__(self, "limits", limits)

    def limits_info(self) -> dict[str, Any]:
        """Every limit this server enforces, by name: the core's and the loop's (``/info``)."""
        return {
            **self.limits.to_dict(),
            "timeout": self.timeout,
            "head_timeout": self.head_timeout,
            "max_connections": self.max_connections,
        }

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @classmethod
    def flags(cls) -> tuple[Flag, ...]:
        """The flag table: the common flags, then the role's."""
        return COMMON_FLAGS + cls.ROLE_FLAGS

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Each field's default, by name: what an absent flag and variable leave."""
        return {f.name: f.default for f in fields(cls) if f.default is not MISSING}

    @classmethod
    def build_parser(cls, prog: str | None = None) -> argparse.ArgumentParser:
        """The parser of ``meshnet-<role>``; defaults are applied later, by :meth:`load`."""
        parser = OneLineParser(
            prog=prog or f"meshnet-{cls.role}",
            description=f"meshnet wire-2 {cls.role}. Every flag can also be set as MESHNET_<FLAG>.",
        )
        add_flags(parser, cls.flags(), cls.defaults())
        return parser

    @classmethod
    def load(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> Self:
        """Parse ``argv`` with ``environ`` fallbacks; exits (status 2) on a bad value."""
        parser = cls.build_parser()
        given = vars(parser.parse_args(argv))
        values = cls._values(given, os.environ if environ is None else environ, parser.error)
        if (values["tls_cert"] is None) != (values["tls_key"] is None):
            parser.error("--tls-cert and --tls-key go together")
        if values["accept_token"] is not None and values["token"] is None:
            parser.error("--accept-token is a second chain token: give --token too")
        cls.check_role(values, parser.error)
        try:
            return cls(**values)  # builds and validates its Limits
        except (TypeError, ValueError) as exc:
            parser.error(str(exc))

    @classmethod
    def _values(
        cls, given: dict[str, Any], env: Mapping[str, str], error: Callable[[str], NoReturn]
    ) -> dict[str, Any]:
        """Each flag's value: given on the command line, else its variable, else the default."""
        defaults = cls.defaults()
        values: dict[str, Any] = {}
        for flag in cls.flags():
            if flag.dest in given:
                values[flag.dest] = given[flag.dest]
            elif flag.env in env:
                try:
                    values[flag.dest] = flag.kind(env[flag.env])
                except argparse.ArgumentTypeError as exc:
                    error(f"{flag.env}: {exc}")
            else:
                values[flag.dest] = defaults[flag.dest]
        return values

    @classmethod
    def check_role(cls, values: dict[str, Any], error: Callable[[str], NoReturn]) -> None:
        """The role's checks of flags that go together; may rewrite ``values`` in place."""


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flags: Sequence[Flag],
    defaults: Mapping[str, Any],
    *,
    kind: Callable[[Flag], Callable[[str], Any]] = lambda flag: flag.kind,
    helps: Mapping[str, str] | None = None,
) -> None:
    """Add ``flags`` to ``parser`` as a role's parser has them: absent stays
    absent (``SUPPRESS``, so the environment can fill it), ``--help`` shows
    the variable and the default. ``kind`` may wrap a flag's parser (``meshnet
    run`` keeps the text it forwards), ``helps`` replace a flag's help text."""
    for flag in flags:
        choices = getattr(flag.kind, "choices", None)
        text = (helps or {}).get(flag.name, flag.help)
        parser.add_argument(
            flag.name,
            type=kind(flag),
            default=argparse.SUPPRESS,
            metavar="{" + ",".join(choices) + "}" if choices else None,
            help=f"{text} [env {flag.env}, default {defaults[flag.dest]}]",
        )


def model_path_problem(path: str) -> str | None:
    """Why ``--model PATH`` names no model, with what it takes; None when it
    may (the loader then reads it). Checked first, so ``--model README.md``
    says that, not that ``README.md/config.json`` is no JSON."""
    want = "give a .gguf file or a checkpoint directory with config.json, HF layout"
    if not os.path.exists(path):
        return f"cannot load --model {path}: no such file or directory ({want})"
    if os.path.isdir(path):
        if not path.lower().endswith(".gguf") and not os.path.isfile(
            os.path.join(path, "config.json")
        ):
            return f"cannot load --model {path}: a directory without config.json ({want})"
        return None
    if not path.lower().endswith(".gguf"):
        return f"cannot load --model {path}: a file but not a .gguf file ({want})"
    return None


def split_replicas(values: dict[str, Any], hop: str) -> None:
    """A parsed ``URL[,URL...]`` flag: ``hop`` its first URL, ``<hop>_replicas`` them all."""
    if isinstance(values.get(hop), tuple):
        values[f"{hop}_replicas"] = values[hop]
        values[hop] = values[hop][0]

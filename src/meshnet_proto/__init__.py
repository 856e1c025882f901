"""meshnet_proto: the sans-IO core of meshnet's wire 2.

Bytes go in, events come out; events go in, bytes come out. Nothing here
opens a socket, starts a thread, runs an event loop or reads a clock: time is
an argument wherever it matters. See ``docs/core-api.md`` for the contract.

Every public name is re-exported here from the private module that owns it;
import from ``meshnet_proto``, never from the ``_modules``.
"""

from ._budget import *  # noqa: F403
from ._budget import __all__ as _budget_all
from ._chunking import *  # noqa: F403
from ._chunking import __all__ as _chunking_all
from ._client import *  # noqa: F403
from ._client import __all__ as _client_all
from ._client_sessions import *  # noqa: F403
from ._client_sessions import __all__ as _client_sessions_all
from ._codec import *  # noqa: F403
from ._codec import __all__ as _codec_all
from ._dtypes import *  # noqa: F403
from ._dtypes import __all__ as _dtypes_all
from ._errors import *  # noqa: F403
from ._errors import __all__ as _errors_all
from ._events import *  # noqa: F403
from ._events import __all__ as _events_all
from ._headers import *  # noqa: F403
from ._headers import __all__ as _headers_all
from ._integers import *  # noqa: F403
from ._integers import __all__ as _integers_all
from ._limits import *  # noqa: F403
from ._limits import __all__ as _limits_all
from ._policy import *  # noqa: F403
from ._policy import __all__ as _policy_all
from ._sequencer import *  # noqa: F403
from ._sequencer import __all__ as _sequencer_all
from ._server import *  # noqa: F403
from ._server import __all__ as _server_all
from ._topology import *  # noqa: F403
from ._topology import __all__ as _topology_all

WIRE_VERSION = 2

__version__ = "0.1.0"

__all__ = sorted(
    {
        "WIRE_VERSION",
        "__version__",
        *_budget_all,
        *_chunking_all,
        *_client_all,
        *_client_sessions_all,
        *_codec_all,
        *_dtypes_all,
        *_errors_all,
        *_events_all,
        *_headers_all,
        *_integers_all,
        *_limits_all,
        *_policy_all,
        *_sequencer_all,
        *_server_all,
        *_topology_all,
    }
)

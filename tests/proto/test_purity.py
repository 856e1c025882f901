"""meshnet_proto is sans-IO: importing it pulls in no event loop, socket,
thread or selector module (STYLE lesson 1). Checked in a fresh interpreter,
because this test process has imported all of them already."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = ["trio", "anyio", "asyncio", "socket", "threading", "selectors"]


def test_import_pulls_in_no_io_modules() -> None:
    code = (
        "import json, sys\n"
        "import meshnet_proto\n"
        f"print(json.dumps([m for m in {FORBIDDEN!r} if m in sys.modules]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert json.loads(result.stdout) == []


def test_a_full_exchange_pulls_in_no_io_modules() -> None:
    # Lazy imports would dodge the first test; run a round trip as well.
    code = """
import json, sys
import numpy as np
from meshnet_proto import (
    ClientConnection, ServerConnection, WireHeaders, encode_tensor, NEED_DATA,
)
array = np.ones((1, 4, 2), dtype=np.float32)
wire = WireHeaders.for_array(
    array, session="5b1e0c2a-9f3d-4c1e-8a7b-0123456789ab", chunk_index=0, chunk_total=1,
    encoding="zstd",
)
client, server = ClientConnection(), ServerConnection()
for piece in client.send_activation(wire, encode_tensor(array, encoding="zstd")):
    server.receive_data(bytes(piece))
server.next_event()
received = server.next_event()
for piece in server.send_activation(wire, encode_tensor(received.tensor, encoding="zstd")):
    client.receive_data(bytes(piece))
assert client.next_event().tensor.tobytes() == array.tobytes()
print(json.dumps([m for m in FORBIDDEN if m in sys.modules]))
""".replace("FORBIDDEN", repr(FORBIDDEN))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert json.loads(result.stdout) == []


def test_no_module_of_the_core_imports_io_or_a_clock() -> None:
    # sys.modules cannot show `time` (the interpreter itself loads it), so
    # read the sources: no module of the core may import these at all.
    import ast
    from pathlib import Path

    import meshnet_proto

    banned = {*FORBIDDEN, "time"}
    package = Path(meshnet_proto.__file__).parent
    offenders = []
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            offenders += [f"{path.name}: {name}" for name in names if name.split(".")[0] in banned]
    assert offenders == []

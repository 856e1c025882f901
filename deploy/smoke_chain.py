"""The image's smoke test, run inside it (deploy/build-image.sh bind-mounts
this file and the model, read-only): two stages and a gateway as separate
processes, as Kubernetes runs them, and one greedy completion through them.

    python smoke_chain.py /models/MODEL.gguf [PROMPT]

Checks the image's promises first: not root, no C compiler on the PATH, the
model mounted read-only. Prints what the chain answered; exits 0 only when
every check passed and the answer came back. Standard library and the
image's own packages only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import IO

TOKEN = "smoke-test-chain-token"
READY_WITHIN = 300.0  # seconds a process has to print its ready line (a model load)
LISTENING = re.compile(r"listening on (\S+)")


def check_image(model: str) -> None:
    """What the Containerfile promises, seen from inside."""
    assert os.getuid() != 0, "the image runs as root"
    compilers = [c for c in ("cc", "gcc", "c++", "g++", "clang") if shutil.which(c)]
    assert not compilers, f"a compiler in the final image: {compilers}"
    # A bind mount's read-only flag, not the file's mode (which a non-root
    # user could not write through anyway).
    assert os.statvfs(model).f_flag & os.ST_RDONLY, f"{model} is not mounted read-only"
    print(f"image: uid {os.getuid()}, no C compiler on the PATH, {model} mounted read-only")


def start(argv: list[str]) -> tuple[subprocess.Popen[str], str]:
    """A server started with ``--port 0``, and the URL its ready line names."""
    env = {**os.environ, "MESHNET_TOKEN": TOKEN}  # the credential from the environment
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout is not None
    line = _first_line(process.stdout)
    found = LISTENING.search(line)
    if found is None:
        process.kill()
        raise SystemExit(f"{argv[0]} exited before its ready line (status {process.wait()})")
    print(f"  {line.strip()[:160]}")
    return process, found.group(1)


def _first_line(stdout: IO[str]) -> str:
    # The ready line is the first line on stdout (logs go to stderr); a
    # process that dies first closes it, and readline returns "".
    return stdout.readline()


def wait_ready(url: str) -> None:
    """Until the gateway's readiness probe passes (its chain check), bounded."""
    deadline = time.monotonic() + READY_WITHIN
    while True:
        try:
            with urllib.request.urlopen(url + "/health?ready=1", timeout=10) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


def complete(url: str, model: str, prompt: str) -> str:
    name = os.path.basename(model).removesuffix(".gguf")  # the gateway's default model id
    document = {"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    request = urllib.request.Request(
        url + "/v1/completions",
        json.dumps(document).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            text: str = json.loads(answer.read())["choices"][0]["text"]
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"completion refused: {exc.code} {exc.read()[:300]!r}") from None
    return text


def main() -> int:
    model = sys.argv[1]
    prompt = sys.argv[2] if len(sys.argv) > 2 else "The capital of France is"
    check_image(model)
    from meshnet_model.plan import plan_stages

    stages = plan_stages(model, 2, engine="numpy", dtype="float32")
    layers = [str(stage["layers"]) for stage in stages]
    common = ["--host", "127.0.0.1", "--port", "0", "--log-level", "warning"]
    node = ["meshnet-node", *common, "--model", model, "--engine", "numpy", "--dtype", "float32"]
    processes: list[subprocess.Popen[str]] = []
    try:
        print(f"chain: {model}, stages {', '.join(layers)}")
        last, last_url = start([*node, "--layers", layers[1]])
        processes.append(last)
        first, first_url = start([*node, "--layers", layers[0], "--next", last_url])
        processes.append(first)
        gateway, url = start(["meshnet-gateway", *common, "--entry", first_url, "--model", model])
        processes.append(gateway)
        wait_ready(url)
        answer = complete(url, model, prompt)
        print(f"completion: {prompt!r} -> {answer!r}")
        return 0 if answer.strip() else 1
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            process.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())

"""Memory of one stage of a GGUF model vs the whole model (docs/models.md).

Writes a SmolLM-135M-shaped random model as a Q8_0 GGUF file (30 layers,
hidden 576, vocab 49152, tied head), then loads, each in a fresh process,
the whole model and each half with ``StageWeights.load`` and prints the
process's peak and current RSS (VmHWM/VmRSS), and the weights' bytes.

    PYTHONPATH=src python benchmarks/bench_gguf_rss.py [--dtype float32] [--dir /tmp/x]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import sys
from meshnet_model import StageWeights
from meshnet_model.stage.weights import parse_layers
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
before = status("VmRSS")
w = StageWeights.load(sys.argv[1], parse_layers(sys.argv[2]), dtype=sys.argv[3])
print(before, status("VmHWM"), status("VmRSS"), status("RssAnon"), status("RssFile"), w.nbytes)
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--qtype", default="Q8_0")
    args = parser.parse_args()
    from meshnet_model.testing import random_weights, smollm_135m_config
    from meshnet_model.testing.gguf import write_gguf

    root = Path(args.dir or tempfile.mkdtemp())
    path = root / f"smollm-shape-{args.qtype.lower()}.gguf"
    if not path.exists():
        config = smollm_135m_config()
        write_gguf(path, config.to_dict(), random_weights(config, seed=0), qtype=args.qtype)
    print(f"{path.name}: {path.stat().st_size / 2**20:.1f} MiB on disk, --dtype {args.dtype}")
    for layers in ("0:30", "0:15", "15:30"):
        out = subprocess.run([sys.executable, "-c", CHILD, str(path), layers, args.dtype],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        base, peak, now, anon, mapped, weights = (int(x) / 2**20 for x in out.split())
        print(
            f"layers {layers:>5}: weights {weights:6.1f} MiB; RSS after load {now:6.1f} MiB "
            f"= {anon:6.1f} anonymous + {mapped:5.1f} file pages (peak {peak:6.1f}; "
            f"{base:4.1f} before loading)"
        )


if __name__ == "__main__":
    main()

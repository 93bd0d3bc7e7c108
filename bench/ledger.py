"""What a stream run's ledger costs in each checkpoint: bytes in trainer.pt and seconds to save and load it.

    python bench/ledger.py                    # 600,000 samples (the published Kimi-K2.5 draft's data)
    python bench/ledger.py --samples 6000000 --out results/stream/ledger_6m.json

One epoch's ledger on one rank (every sample sent, delivered and trained: the largest a checkpoint
holds, each entry with its state and attempt), saved as train.loop.save saves it (`state_dict`, under
trainer.pt's "stream" key, torch.save) and read back as a resume reads it (torch.load with
weights_only=True, then Ledger.from_state_dict); the restored ledger must say every sample trained.
With R ranks each holds samples / R of them.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eyas.stream.ledger import TRAINED, Ledger  # noqa: E402


def measure(samples: int) -> dict:
    led = Ledger(0, list(range(samples)))
    for i in range(samples):
        led.arrived(led.send(i, "engine-0"))
    led.trained(list(range(samples)))
    t0 = time.perf_counter()
    buf = io.BytesIO()
    torch.save({"stream": [led.state_dict()]}, buf)
    t1 = time.perf_counter()
    buf.seek(0)
    back = Ledger.from_state_dict(torch.load(buf, weights_only=True)["stream"][0])
    t2 = time.perf_counter()
    if back.count(TRAINED) != samples:
        raise SystemExit(f"the restored ledger says {back.count(TRAINED)} of {samples} samples trained")
    return {"samples": samples, "bytes": len(buf.getvalue()), "bytes_per_sample": len(buf.getvalue()) / samples,
            "save_s": round(t1 - t0, 2), "load_s": round(t2 - t1, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=600_000)
    ap.add_argument("--out", default="", help="write the record here as JSON")
    a = ap.parse_args()
    r = {**measure(a.samples), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
         "machine": f"{platform.machine()}, {os.cpu_count()} cores", "command": "python " + " ".join(sys.argv)}
    print(f"{r['samples']:,} samples: {r['bytes'] / 1e6:.1f} MB ({r['bytes_per_sample']:.1f} bytes per sample), "
          f"saved in {r['save_s']} s, loaded in {r['load_s']} s")
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()

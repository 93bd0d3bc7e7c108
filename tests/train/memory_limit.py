"""`python tests/train/memory_limit.py MIB eyas-args...`: the eyas command, with an address-space limit
(RLIMIT_AS) set when training starts (eyas.train.loop.fit is entered) at what the process maps then
plus MIB MiB: a real allocation failure inside the training steps, wherever the loading before them
took its memory."""

import functools
import re
import resource
import sys
from pathlib import Path

import eyas.train.loop
from eyas.cli import main


def limited(fit, margin_mib: int):
    @functools.wraps(fit)
    def run(*args, **kwargs):
        mapped = int(re.search(r"VmSize:\s+(\d+)", Path("/proc/self/status").read_text())[1]) * 1024
        limit = mapped + (margin_mib << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
        print(f"[memory_limit] RLIMIT_AS {limit >> 20} MiB ({mapped >> 20} MiB mapped + {margin_mib})", flush=True)
        return fit(*args, **kwargs)

    return run


if __name__ == "__main__":
    eyas.train.loop.fit = limited(eyas.train.loop.fit, int(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))

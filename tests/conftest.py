"""Suite-wide fixtures for every test. The tests mirror the package (tests/train/test_loop.py checks
eyas/train/loop.py); tiny models and drafts are built in tests/models.py, chat data and prepare runs
in tests/data.py; a directory's own fixtures are in its conftest.py, its shared helpers in its runs.py."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread for every test: the models here are tiny (all per-op overhead), and on a
    shared 2-core machine OpenMP spin-waits made 2 threads 5-50x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M-Instruct as a bf16 safetensors HF directory (converted once, cached)."""
    from eyas.assets import smollm2_dir as _dir

    return _dir()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="session")
def tcfg(smollm2_dir):
    """SmolLM2-135M-Instruct's HF config (the drafts of tests/smollm2_drafts.py are sized from it)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(smollm2_dir))


@pytest.fixture
def shm_dir(tmp_path):
    """A directory on /dev/shm (a tmpfs: another filesystem than tmp_path's), removed afterwards:
    extract.spill_dirs tests put the output directory there and spill onto tmp_path's disk."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    if not Path("/dev/shm").is_dir() or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's tmp_path")
    d = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="eyas-test-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


ENGINES = "engines"
"""The xdist group of the tests that start vLLM, a Ray cluster or a Mooncake store (marked vllm, or
under tests/stream/): they run one at a time, in one worker, first, while the other worker runs the
rest. Two engines at once on 2 cores would each crawl (OpenMP threads pinned to the same cores)."""


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns the marks into groups
def pytest_collection_modifyitems(config, items):
    """Under `pytest -n 2 --dist loadgroup` (make test): the engine tests form one group, run first
    (the longest unit); every other module is a group of its own, so its module fixtures are built
    once. A run without --dist loadgroup is left as it is."""
    if not getattr(config.option, "loadgroup", False):  # set in xdist's workers under --dist loadgroup
        return
    group = {}
    for item in items:
        engine = item.get_closest_marker("vllm") is not None or "/tests/stream/" in str(item.path)
        group[item] = ENGINES if engine else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group[item]))
    items.sort(key=lambda item: group[item] != ENGINES)

"""The ``calibrate_shard.py`` script of docs/distributed.md, run as the page says on more ranks than
it has batches (7 gloo ranks over its 6 batches: the last rank's ``batches[rank::world]`` is empty),
which the page says it merges: the saved input states equal one process calibrating every batch,
bit for bit. A rank without batches gets only weight sites from ``calibrate``."""

from __future__ import annotations

import os
import re
import runpy
import sys
import traceback
from pathlib import Path

import torch

import qstats

sys.path.insert(0, os.path.dirname(__file__))
from _shared import exit_rank, fork_ranks  # noqa: E402

PAGE = Path(__file__).resolve().parent.parent / "docs" / "distributed.md"
WORLD = 7


def _script() -> str:
    """The page's ``calibrate_shard.py`` block."""
    match = re.search(r"<!-- file: calibrate_shard\.py -->\n```python\n(.*?)```", PAGE.read_text(), re.S)
    assert match, "docs/distributed.md has no calibrate_shard.py block"
    return match.group(1)


def _rank(rank: int, port: int, folder: str) -> None:
    """One rank started as torchrun starts it: the rendezvous in the environment, the script as __main__."""
    code = 0
    try:
        os.chdir(folder)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), TORCH_DIST_INIT_BARRIER="0")
        torch.set_num_threads(1)
        runpy.run_path("calibrate_shard.py", run_name="__main__")
    except BaseException:
        Path(folder, f"rank{rank}.err").write_text(traceback.format_exc())
        code = 1
    exit_rank(code)


def test_the_shard_script_on_more_ranks_than_batches_equals_one_process(tmp_path):
    (tmp_path / "calibrate_shard.py").write_text(_script())
    script = runpy.run_path(str(tmp_path / "calibrate_shard.py"))
    model, batches = script["model_and_batches"]()
    assert len(batches) < WORLD and not batches[WORLD - 1::WORLD]  # the last rank has no batch
    one_process = qstats.calibrate(model, batches, script["RECIPE"], progress=False)  # (its imports: before the fork)
    codes = fork_ranks(_rank, str(tmp_path), world=WORLD, timeout=180)
    errors = {path.name: path.read_text()[-2000:] for path in tmp_path.glob("rank*.err")}
    assert codes == [0] * WORLD, (codes, errors)
    merged = qstats.load(tmp_path / f"inputs_{WORLD}_ranks.safetensors")
    assert sorted(merged) == sorted(one_process)
    for path, sites in one_process.items():
        assert list(merged[path]) == ["input"], merged[path]
        assert type(merged[path]["input"]) is type(sites["input"])
        for got, want in zip(merged[path]["input"], sites["input"]):
            assert got.dtype == want.dtype and torch.equal(got, want), path

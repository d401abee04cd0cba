"""Committed autotuning picks (``kernels.tuning_picks``): a fresh machine launches each GPU's recorded best config
for a kernel and key instead of timing the space; anything the table does not match is tuned as before."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from kernels import tuning, tuning_picks

SPACE = [({"B": 16}, 4), ({"B": 32}, 4), ({"B": 32}, 2)]
GPU = "Test GPU"


@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch) -> dict:
    """An empty table for GPU, the present machine taken for that GPU; tests fill it."""
    entries: dict = {GPU: {}}
    monkeypatch.setattr(tuning_picks, "_table", lambda: entries)
    monkeypatch.setattr(tuning_picks, "_gpu", lambda: GPU)
    monkeypatch.delenv("LONGWEAVE_TUNING", raising=False)
    return entries


def space() -> list[triton.Config]:
    return [tuning.config(*entry) for entry in SPACE]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the launch without timing (interpreter only)")
def test_the_pick_is_launched_under_tritons_own_key(table: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook forms the key as Triton's Autotuner does (the key the tuner files its choice under is the table's),
    and the launch runs the picked config without timing any (timing needs a GPU: it would fail here)."""
    monkeypatch.setattr(tuning, "configs", lambda entries: [tuning.config(*e) for e in entries])  # the whole space

    @tuning.autotune(SPACE, key=["n"])
    @triton.jit
    def scale_kernel(x, y, n, B: tl.constexpr) -> None:
        offs = tl.arange(0, B)
        tl.store(y + offs, tl.load(x + offs, mask=offs < n) * B, mask=offs < n)

    key = (10, "torch.float32", "torch.float32")
    table[GPU]["scale_kernel"] = {tuning_picks.key_text(key): tuning_picks.describe(space()[2])}
    x = torch.randn(10)
    y = torch.empty_like(x)
    scale_kernel[(1,)](x, y, 10)
    torch.testing.assert_close(y, x * 32)
    assert list(scale_kernel.cache) == [key]
    assert tuning_picks.describe(scale_kernel.cache[key]) == tuning_picks.describe(space()[2])


def hook(prune=None):  # noqa: ANN001, ANN201 - an early_config_prune hook and its result
    return tuning_picks.with_picks("k", ["x", "n"], ["n"], prune)


def test_a_space_is_left_whole_where_the_table_does_not_match(table: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(4, dtype=torch.bfloat16)
    key = tuning_picks.key_text((64, "torch.bfloat16"))
    table[GPU]["k"] = {key: tuning_picks.describe(space()[1])}
    assert hook()(space(), {"x": x, "n": 64}) == [space()[1]]  # the pick
    assert hook()(space(), {"x": x, "n": 65}) == space()  # another key
    assert hook()(space(), {"x": x.float(), "n": 64}) == space()  # another dtype
    assert hook()(space()[:1], {"x": x, "n": 64}) == space()[:1]  # a stale pick: not in the space any more
    assert hook(lambda s, args, **kw: s[::2])(space(), {"x": x, "n": 64}) == space()[::2]  # the kernel's prune first
    assert hook(lambda s, args, **kw: s[1:])(space(), {"x": x}, n=64) == [space()[1]]  # a key passed by keyword
    monkeypatch.setattr(tuning_picks, "_gpu", lambda: "Other GPU")
    assert hook()(space(), {"x": x, "n": 64}) == space()
    monkeypatch.setattr(tuning_picks, "_gpu", lambda: GPU)
    monkeypatch.setenv("LONGWEAVE_TUNING", "full")
    assert hook()(space(), {"x": x, "n": 64}) == space()


def test_keys_timed_for_want_of_a_pick_are_reported_once(table: dict) -> None:
    tuning_picks.drain_timed()
    x = torch.zeros(4, dtype=torch.bfloat16)
    table[GPU]["k"] = {tuning_picks.key_text((64, "torch.bfloat16")): tuning_picks.describe(space()[1])}
    hook()(space(), {"x": x, "n": 64})  # picked: nothing timed
    hook()(space(), {"x": x, "n": 65})  # no pick: the space is timed
    hook()(space()[:1], {"x": x, "n": 65})  # one config: nothing to time
    assert tuning_picks.drain_timed() == {"k": 1}
    assert not tuning_picks.drain_timed()
    assert tuning_picks.record_command().startswith("python -m kernels.tuning_picks --cache ")


def write_result(cache: Path, folder: str, kernel: str, key: tuple, timings: list[list[float]], mtime: int) -> None:
    """An autotuning result as Triton's Autotuner.check_disk_cache writes one."""
    path = cache / folder / f"{kernel}.autotune.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"key": key, "configs_timings": [(c.__dict__, t) for c, t in zip(space(), timings)]}))
    os.utime(path, (mtime, mtime))


def test_picks_are_read_from_tritons_cache_and_merged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "triton"
    key = (64, True, "torch.bfloat16")
    # Triton compares quantile lists element by element: [1.0, 0.4] is less than [1.0, 0.5] and [1.2, 0.1]
    write_result(cache, "a", "k", key, [[1.2, 0.1], [1.0, 0.5], [1.0, 0.4]], mtime=1000)
    write_result(cache, "b", "k", (128, True, "torch.bfloat16"), [[1.0], [2.0], [3.0]], mtime=1000)
    write_result(cache, "c", "other", key, [[3.0], [2.0], [1.0]], mtime=1000)
    found = tuning_picks.read_cache(cache)
    assert found["k"][tuning_picks.key_text(key)] == tuning_picks.describe(space()[2])
    assert found["k"][tuning_picks.key_text((128, True, "torch.bfloat16"))] == tuning_picks.describe(space()[0])
    write_result(cache, "d", "k", key, [[2.0], [1.0], [3.0]], mtime=2000)  # the kernel's source changed since
    assert tuning_picks.read_cache(cache)["k"][tuning_picks.key_text(key)] == tuning_picks.describe(space()[1])

    output = tmp_path / "picks.json"
    output.write_text(json.dumps({GPU: {"k": {"[1]": {"kept": True}}}, "Other GPU": {"k": {}}}))
    monkeypatch.setattr("sys.argv", ["tuning_picks", "--cache", str(cache), "--gpu", GPU, "--output", str(output)])
    tuning_picks.main()
    table = json.loads(output.read_text())
    assert table[GPU]["k"]["[1]"] == {"kept": True}  # a key this run did not tune keeps its pick
    assert table[GPU]["k"][tuning_picks.key_text(key)] == tuning_picks.describe(space()[1])
    assert table[GPU]["other"][tuning_picks.key_text(key)] == tuning_picks.describe(space()[2])
    assert table["Other GPU"] == {"k": {}}


def test_every_committed_pick_is_in_its_kernels_present_space() -> None:
    """A pick the code no longer offers (a space changed) would silently send that kernel back to timing its space:
    drop it from `kernels/tuning_picks.json`, or tune again on that GPU and merge."""
    import kernels.attn_res
    import kernels.kda
    import kernels.short_conv  # noqa: F401 - registers their spaces

    table = json.loads(tuning_picks.TABLE.read_text())
    assert table, "the committed table is empty"
    for gpu, kernels_picks in table.items():
        for kernel, picks in kernels_picks.items():
            assert kernel in tuning.SPACES, f"{gpu}: no autotuned kernel {kernel}"
            offered = [tuning_picks.describe(tuning.config(*entry)) for entry in tuning.SPACES[kernel]]
            stale = [key for key, pick in picks.items() if pick not in offered]
            assert not stale, f"{gpu}: {kernel}'s picks for {stale} are not in its space"

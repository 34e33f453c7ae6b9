"""The namespace names the weights, not the path: `kvtier.weights.weights_identity` on real checkpoint files, every
byte of them, remembered by file identity (`kvtier.digests`); a hub id by the snapshot it was loaded from."""

from __future__ import annotations

import json
import os
import shutil
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from kvtier.digests import CACHE_NAME, RACY_S, FileDigests, identity
from kvtier.integrations.vllm.setup import weights_folder
from kvtier.weights import NoWeights, hub_snapshot, weights_identity

CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "_name_or_path": "/somewhere"}


def checkpoint(path, seed: int, config: dict = CONFIG, n: int = 256):
    path.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    save_file({"w": torch.randn(n, n, generator=gen), "b": torch.randn(n, generator=gen)},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def identify(path, tmp_path, config: dict = CONFIG) -> tuple[str, int]:
    """The identity as a fresh start computes it (a new FileDigests over one cache folder), and the bytes it read."""
    digests = FileDigests(tmp_path / "cache")
    digests.racy_s = 0  # these files are seconds old: remembered at once (the guard has a test of its own)
    return weights_identity(path, config, digests=digests), digests.hashed_bytes


def rewrite_in_place(path, offset: int, keep_mtime: bool = True) -> None:
    """A fine-tune of one tensor's bytes, same shapes and sizes, written into the same file (same inode)."""
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    if keep_mtime:  # what a careless copy tool or a restore does: the mtime says nothing changed
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_the_same_weights_at_another_path_are_the_same_model(tmp_path):
    a = checkpoint(tmp_path / "a", seed=0)
    shutil.copytree(a, tmp_path / "elsewhere")
    moved = {**CONFIG, "_name_or_path": "/elsewhere"}
    assert identify(a, tmp_path)[0] == identify(tmp_path / "elsewhere", tmp_path, moved)[0]


def test_a_new_checkpoint_at_the_same_path_is_another_model(tmp_path):
    path = checkpoint(tmp_path / "m", seed=0)
    before = identify(path, tmp_path)[0]
    shutil.rmtree(path)
    checkpoint(tmp_path / "m", seed=1)  # a fine-tune: same names, shapes, sizes and header
    assert identify(path, tmp_path)[0] != before


def test_config_and_quantization_are_part_of_it_and_bytes_decide_the_rest(tmp_path):
    path = checkpoint(tmp_path / "m", seed=0)
    base = identify(path, tmp_path)[0]
    assert identify(path, tmp_path, {**CONFIG, "rope_theta": 1e6})[0] != base
    assert weights_identity(path, CONFIG, quantization="fp8", digests=FileDigests(tmp_path / "cache")) != base


def test_a_name_that_is_no_folder_here_identifies_nothing(tmp_path):
    """A name says nothing of the bytes under it: the caller (the vLLM connector) resolves a hub id to its
    snapshot, or names the weights as its own engine's."""
    with pytest.raises(NoWeights, match="org/model"):
        weights_identity("org/model", CONFIG)
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoWeights, match="no weight files"):
        weights_identity(tmp_path / "empty", CONFIG)


def test_a_checkpoint_updated_in_place_is_another_model_wherever_the_change_is(tmp_path):
    """r_weights_sampled.py: the identity hashed a file's size, safetensors header and 16 samples of 64 KiB. A
    checkpoint updated in place whose changed tensors fell between the samples kept its identity, and the disk and
    Redis tiers served KV of the old weights. Every byte is read now."""
    path = checkpoint(tmp_path / "m", seed=0, n=1024)  # 4 MiB: the 16 old samples left gaps
    shard = path / "model.safetensors"
    size = os.path.getsize(shard)
    old_samples = [max(0, size - (64 << 10)) * i // 15 for i in range(16)]
    between = next(o for o in range(size // 2, size) if not any(s <= o < s + (64 << 10) for s in old_samples))
    seen = {identify(path, tmp_path)[0]}
    for offset in (between, size - 1):
        rewrite_in_place(shard, offset)
        seen.add(identify(path, tmp_path)[0])
    assert len(seen) == 3


def test_a_restart_reads_no_weight_file_again_and_a_rewrite_in_place_is_read_whole(tmp_path):
    """The digest is remembered under the file's identity (device, inode, size, mtime, ctime): a restart over
    unchanged files reads nothing; a rewrite in place that even puts the mtime back changes the ctime, and the file
    is read again. (Files written within RACY_S of their hashing are never remembered: they are made older here.)"""
    path = checkpoint(tmp_path / "m", seed=0)
    size = os.path.getsize(path / "model.safetensors")
    time.sleep(RACY_S + 0.1)
    cache = tmp_path / "cache"
    first = FileDigests(cache)
    identity_0 = weights_identity(path, CONFIG, digests=first)
    assert first.hashed_bytes == size
    again = FileDigests(cache)
    assert weights_identity(path, CONFIG, digests=again) == identity_0 and again.hashed_bytes == 0
    rewrite_in_place(path / "model.safetensors", size // 2)
    after = FileDigests(cache)
    assert weights_identity(path, CONFIG, digests=after) != identity_0 and after.hashed_bytes == size


def test_a_file_changed_lately_is_hashed_again_next_time(tmp_path):
    """Timestamps have a granularity: a second write in the same tick as the first would leave them alike, so a
    file changed within RACY_S of its hashing is not remembered."""
    path = checkpoint(tmp_path / "m", seed=0)
    FileDigests(tmp_path / "cache").digests([path / "model.safetensors"])
    again = FileDigests(tmp_path / "cache")
    again.digests([path / "model.safetensors"])
    assert again.hashed_bytes == os.path.getsize(path / "model.safetensors")


def test_a_cache_file_others_can_write_is_not_believed(tmp_path):
    """Whoever can write the cache could name new bytes with an old digest: a cache file or folder that another
    user owns or that others can write is not read."""
    path = checkpoint(tmp_path / "m", seed=0)
    shard = path / "model.safetensors"
    truth, _ = identify(path, tmp_path)
    cache = tmp_path / "cache"
    planted = {"format": "kvtier-file-digest-1", "entries": {identity(os.stat(shard)): "00" * 16}}
    (cache / CACHE_NAME).write_text(json.dumps(planted))
    (cache / CACHE_NAME).chmod(0o666)
    digests = FileDigests(cache)
    assert weights_identity(path, CONFIG, digests=digests) == truth and digests.hashed_bytes > 0
    (cache / CACHE_NAME).chmod(0o600)
    assert weights_identity(path, CONFIG, digests=FileDigests(cache)) != truth, "the premise: the entry is used"


def hub_cache(root, repo_id: str, commits: dict[str, int], refs: dict[str, str]):
    """A Hugging Face hub cache as vLLM's download leaves it: snapshots/<commit>/ of each upload (its files links
    to blobs/), refs/<label> naming the commit the label points at. Nothing is downloaded."""
    storage = root / ("models--" + repo_id.replace("/", "--"))
    for commit, seed in commits.items():
        upload = checkpoint(root / "uploads" / commit, seed=seed)
        snapshot = storage / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for f in upload.iterdir():
            blob = storage / "blobs" / f"{commit}-{f.name}"
            blob.parent.mkdir(exist_ok=True)
            shutil.copy(f, blob)
            (snapshot / f.name).symlink_to(blob)
    (storage / "refs").mkdir(exist_ok=True)
    for label, commit in refs.items():
        (storage / "refs" / label).write_text(commit)
    return storage


def test_a_hub_id_is_identified_by_the_bytes_of_the_snapshot_it_was_loaded_from(tmp_path):
    """Found by reading: a model named by a hub id was identified by its name, config and revision label; a
    re-upload under the same label was served the old KV from disk and Redis."""
    a, b = "a" * 40, "b" * 40
    root = tmp_path / "hub"
    hub_cache(root, "org/model", {a: 0, b: 1}, {"main": a})
    first = hub_snapshot("org/model", None, root)
    assert first == root / "models--org--model" / "snapshots" / a
    before, _ = identify(first, tmp_path)
    (root / "models--org--model" / "refs" / "main").write_text(b)  # a re-upload: main moves to another commit
    second = hub_snapshot("org/model", "main", root)
    assert second is not None and identify(second, tmp_path)[0] != before
    assert hub_snapshot("org/model", a, root) == first  # a revision that is a commit hash names its snapshot
    assert hub_snapshot("org/model", "main", root, commit=a) is None  # the config's commit is not the label's
    assert hub_snapshot("org/model", "v2", root) is None and hub_snapshot("org/other", None, root) is None
    assert hub_snapshot("org/model", "../../x", root) is None


def test_the_engine_finds_the_folder_it_loaded_and_never_asks_the_hub(tmp_path):
    """`weights_folder` as the connector calls it with vLLM's model and load configs: a local folder is itself; a
    hub id is the download_dir's snapshot at the config's commit; neither found, None (the engine then names its
    weights as its own)."""
    local = checkpoint(tmp_path / "local", seed=0)
    assert weights_folder(SimpleNamespace(model=str(local)), SimpleNamespace(download_dir=None)) == local
    commit = "c" * 40
    hub_cache(tmp_path / "downloads", "org/model", {commit: 0}, {"main": commit})
    model = SimpleNamespace(model="org/model", revision=None, hf_config=SimpleNamespace(_commit_hash=commit))
    assert weights_folder(model, SimpleNamespace(download_dir=str(tmp_path / "downloads"))) == \
        tmp_path / "downloads" / "models--org--model" / "snapshots" / commit
    elsewhere = SimpleNamespace(download_dir=str(tmp_path / "empty"))
    assert weights_folder(model, elsewhere) is None

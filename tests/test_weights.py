"""The namespace names the weights, not the path: `kvtier.weights.weights_identity` on real checkpoint files."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import save_file

from kvtier.weights import weights_identity

CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "_name_or_path": "/somewhere"}


def checkpoint(path, seed: int, config: dict = CONFIG):
    path.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    save_file({"w": torch.randn(256, 256, generator=gen), "b": torch.randn(256, generator=gen)},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_same_weights_at_another_path_are_the_same_model(tmp_path):
    a = checkpoint(tmp_path / "a", seed=0)
    shutil.copytree(a, tmp_path / "elsewhere")
    moved = {**CONFIG, "_name_or_path": "/elsewhere"}
    assert weights_identity(a, CONFIG) == weights_identity(tmp_path / "elsewhere", moved)


def test_a_new_checkpoint_at_the_same_path_is_another_model(tmp_path):
    path = checkpoint(tmp_path / "m", seed=0)
    before = weights_identity(path, CONFIG)
    shutil.rmtree(path)
    checkpoint(tmp_path / "m", seed=1)  # a fine-tune: same names, shapes, sizes and header
    assert weights_identity(path, CONFIG) != before


def test_config_quantization_and_revision_are_part_of_it(tmp_path):
    path = checkpoint(tmp_path / "m", seed=0)
    base = weights_identity(path, CONFIG)
    assert weights_identity(path, {**CONFIG, "rope_theta": 1e6}) != base
    assert weights_identity(path, CONFIG, quantization="fp8") != base
    assert weights_identity(path, CONFIG, revision="v2") != base


def test_a_name_that_is_no_folder_here_is_named_as_it_is(tmp_path):
    assert weights_identity("org/model", CONFIG) != weights_identity("org/other", CONFIG)
    assert weights_identity("org/model", CONFIG) == weights_identity("org/model", CONFIG)

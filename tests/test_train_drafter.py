"""A second drafter for the trained pair's target (``lab/models/train_drafter.py``), trained a
few steps on the CPU on a stand-in corpus tokenized as the pair's: what it writes is a drafter
folder for the pair's unchanged target."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

PAIR = Path(__file__).resolve().parents[1] / "lab" / "models" / "pairs" / "pycode-4l"


def _stand_in_data(folder: Path, tokenizer_from: Path) -> Path:
    """Prepared data as ``train_pair`` leaves it, with random tokens for the pair's corpus."""
    from lab.models.pair_corpus import _data_key
    from lab.models.train_drafter import load_target

    spec = load_target(PAIR, __import__("torch").device("cpu"))[0]
    folder.mkdir()
    (folder / "tokenizer").mkdir()
    shutil.copy(tokenizer_from / "tokenizer.json", folder / "tokenizer" / "tokenizer.json")
    rng = np.random.default_rng(0)
    np.save(folder / "train.npy", rng.integers(4, 4096, 60_000).astype(np.uint16))
    np.save(folder / "heldout.npy", rng.integers(4, 4096, 20_000).astype(np.uint16))
    (folder / "DONE.json").write_text(json.dumps({"key": _data_key(spec, PAIR / "target")}))
    return folder


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _train(pair: Path, data: Path, *extra: str, layers: str = "0,2") -> int:
    from lab.models.train_drafter import main

    argv = ["--pair", str(pair), "--name", "drafter-test", "--device", "cpu", "--data", str(data)]
    argv += ["--draft-layers", "1", "--target-layer-ids", layers, "--gen-sequences", "4"]
    return main([*argv, "--draft-steps", "2", "--draft-batch", "2", "--eval-prompts", "3", *extra])


def test_a_second_drafter_is_a_drafter_folder_for_the_unchanged_target(tmp_path):
    from safetensors.torch import load_file

    pair = tmp_path / "pair"
    shutil.copytree(PAIR, pair, ignore=shutil.ignore_patterns("drafter-*"))
    target_before = _digest(pair / "target" / "model.safetensors")
    assert _train(pair, _stand_in_data(tmp_path / "data", PAIR / "target")) == 0
    out = pair / "drafter-test"
    config = json.loads((out / "config.json").read_text())
    ours = json.loads((PAIR / "drafter" / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and ours["num_hidden_layers"] == 2
    assert config["dflash_config"]["target_layer_ids"] == [0, 2]
    assert config["dflash_config"]["mask_token_id"] == ours["dflash_config"]["mask_token_id"]
    assert "mask_embedding" not in load_file(out / "model.safetensors")  # the target's row serves it
    assert _digest(pair / "target" / "model.safetensors") == target_before
    record = json.loads((out / "manifest.json").read_text())
    assert record["commit"] and record["created_utc"] and "--draft-layers 1" in record["command"]
    assert record["spec"]["gen_greedy_share"] == 1.0 and record["spec"]["draft_gen_share"] == 1.0
    assert (
        record["drafter"]["steps"] == 2
        and 1.0 <= record["drafter"]["greedy_chain_tokens_per_round_estimate"] <= 8.0
    )


def test_a_drafter_reading_the_targets_last_layer_is_refused_before_training(tmp_path):
    """SGLang taps layer k at layer k + 1's input: a drafter reading the last of the target's 4
    layers would train, then fail at its first served round (a feature-width mismatch)."""
    with pytest.raises(SystemExit, match="can read layers 0..2 of the target's 4"):
        _train(PAIR, tmp_path / "never-prepared", layers="0,1,3")
    assert not (tmp_path / "never-prepared").exists()


@pytest.mark.parametrize("drafter", sorted(p.name for p in PAIR.glob("drafter*") if p.is_dir()))
def test_every_committed_drafter_reads_layers_a_server_can_tap(drafter):
    """What the trace jobs serve: each drafter folder of the pair reads target layers SGLang
    captures (layer k at layer k + 1's input: never the last)."""
    config = json.loads((PAIR / drafter / "config.json").read_text())
    target = json.loads((PAIR / "target" / "config.json").read_text())
    layers = config["dflash_config"]["target_layer_ids"]
    assert layers and all(0 <= k < target["num_hidden_layers"] - 1 for k in layers), layers
    assert config["num_target_layers"] == target["num_hidden_layers"]


def test_the_corpus_is_encoded_by_the_pairs_own_tokenizer(tmp_path):
    """Packages installed since the pair was made change the corpus; its tokens stay the pair's."""
    from lab.models.pair_corpus import prepare_data
    from lab.models.pair_modules import PairSpec

    site = tmp_path / "site-packages" / "pkg"
    site.mkdir(parents=True)
    for i in range(300):
        body = "".join(f"def f{i}_{k}(x):\n    return x + {i * k}\n\n\n" for k in range(40))  # >= 1 kB a file
        (site / f"mod{i}.py").write_text(body)
    data = tmp_path / "data"
    prepare_data(data, PairSpec(), site.parent, lambda line: None, tokenizer_from=PAIR / "target")
    assert (data / "tokenizer" / "tokenizer.json").read_bytes() == (
        PAIR / "target" / "tokenizer.json"
    ).read_bytes()
    train = np.load(data / "train.npy")
    assert train.size > 300 and int(train.max()) < 4096


def test_a_corpus_of_another_tokenizer_is_refused(tmp_path):
    other = tmp_path / "other_tokenizer"
    other.mkdir()
    (other / "tokenizer.json").write_text("{}")
    with pytest.raises(SystemExit, match="is not the pair's tokenizer"):
        _train(PAIR, _stand_in_data(tmp_path / "data", other))

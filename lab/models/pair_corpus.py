"""The trained pair's data: a corpus of Python source from the installed packages
(de-duplicated by content, a fixed share of files held out), a byte-level BPE tokenizer
trained on it, and the token arrays, cached in a ``--data`` folder keyed by the spec."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sysconfig
from collections.abc import Callable
from pathlib import Path

import numpy as np

from lab.models.pair_modules import PairSpec
from lab.models.tiny import SPECIAL_TOKENS

EOS_TOKEN = "<|endoftext|>"


def default_site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _usable(text: str) -> bool:
    if not text.strip():
        return False
    if sum(ch > "\x7f" for ch in text) > 0.02 * len(text):
        return False
    return max(len(line) for line in text.splitlines() or [""]) <= 400


def collect_corpus(root: Path, spec: PairSpec) -> dict:
    """Python files under ``root``: de-duplicated, a deterministic sample of
    ``corpus_bytes``, split into train / held-out by file."""
    seen: set[str] = set()
    docs = []
    for path in sorted(root.rglob("*.py")):
        if "__editable__" in path.name or not path.is_file():
            continue
        size = path.stat().st_size
        if size < 1_000 or size > 200_000:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest in seen or not _usable(text):
            continue
        seen.add(digest)
        order = hashlib.sha256(f"{spec.seed}:{digest}".encode()).hexdigest()
        docs.append((order, digest, str(path.relative_to(root)), text))
    docs.sort()
    kept, total = [], 0
    for doc in docs:
        if total >= spec.corpus_bytes:
            break
        kept.append(doc)
        total += len(doc[3])
    train = [d for d in kept if int(d[1][:8], 16) % 1000 >= spec.heldout_permille]
    heldout = [d for d in kept if int(d[1][:8], 16) % 1000 < spec.heldout_permille]
    packages = sorted({d[2].split("/")[0] for d in kept})
    listing = "\n".join(sorted(d[2] + " " + d[1] for d in kept))
    return {
        "train": [d[3] for d in train],
        "heldout": [d[3] for d in heldout],
        "heldout_paths": [d[2] for d in heldout],
        "info": {
            "source": "Python source (*.py) of the installed packages in site-packages",
            "root": str(root),
            "python": platform.python_version(),
            "candidate_files": len(docs),
            "files": len(kept),
            "train_files": len(train),
            "heldout_files": len(heldout),
            "bytes": total,
            "train_bytes": sum(len(d[3]) for d in train),
            "heldout_bytes": sum(len(d[3]) for d in heldout),
            "packages": len(packages),
            "package_sample": packages[:40],
            "file_list_sha256": hashlib.sha256(listing.encode()).hexdigest(),
            "filters": "1-200 kB, UTF-8, <=2% non-ASCII, lines <=400 chars, exact duplicates dropped",
        },
    }


def train_tokenizer(texts: list[str], spec: PairSpec, folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    sample, total = [], 0
    for text in texts:
        if total >= spec.tokenizer_bytes:
            break
        sample.append(text)
        total += len(text)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sample, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t != EOS_TOKEN],
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)


def _encode(tok, texts: list[str]) -> list[np.ndarray]:
    out = []
    for i in range(0, len(texts), 256):
        for enc in tok.backend_tokenizer.encode_batch(texts[i : i + 256]):
            out.append(np.asarray(enc.ids, dtype=np.uint16))
    return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def prepare_data(
    data: Path,
    spec: PairSpec,
    site_packages: Path,
    log: Callable[[str], None],
    tokenizer_from: Path | None = None,
) -> None:
    """Corpus, tokenizer and token arrays into ``data`` (skipped when already there). With
    ``tokenizer_from`` (a trained pair's target folder) the corpus is encoded by that tokenizer
    instead of a newly trained one: the packages installed since the pair was made change the
    corpus, and a new BPE on it would not be the pair's."""
    key = _data_key(spec, tokenizer_from)
    done = data / "DONE.json"
    if done.exists() and json.loads(done.read_text()).get("key") == key:
        log(f"data: reusing {data}")
        return
    from transformers import AutoTokenizer

    log(f"data: collecting Python files under {site_packages}")
    corpus = collect_corpus(site_packages, spec)
    log(f"data: {json.dumps({k: v for k, v in corpus['info'].items() if k != 'package_sample'})}")
    tmp = data.with_name(data.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if tokenizer_from is None:
        train_tokenizer(corpus["train"], spec, tmp / "tokenizer")
    else:
        (tmp / "tokenizer").mkdir(parents=True)
        for name in TOKENIZER_FILES:
            shutil.copy(tokenizer_from / name, tmp / "tokenizer" / name)
    tok = AutoTokenizer.from_pretrained(tmp / "tokenizer")
    eos = tok.convert_tokens_to_ids(EOS_TOKEN)
    log(f"data: tokenizer of {len(tok)} tokens {'trained' if tokenizer_from is None else 'copied'}; encoding")
    train_docs = _encode(tok, corpus["train"])
    heldout_docs = _encode(tok, corpus["heldout"])
    sep = np.asarray([eos], dtype=np.uint16)
    train = np.concatenate([x for doc in train_docs for x in (doc, sep)])
    heldout = np.concatenate([x for doc in heldout_docs for x in (doc, sep)])
    offsets = np.cumsum([0] + [len(d) + 1 for d in heldout_docs])[:-1]
    np.save(tmp / "train.npy", train)
    np.save(tmp / "heldout.npy", heldout)
    np.save(tmp / "heldout_offsets.npy", offsets.astype(np.int64))
    info = {
        **corpus["info"],
        "train_tokens": int(train.size),
        "heldout_tokens": int(heldout.size),
        "bytes_per_token": round(corpus["info"]["train_bytes"] / max(train.size, 1), 3),
    }
    (tmp / "heldout_paths.json").write_text(json.dumps(corpus["heldout_paths"]))
    (tmp / "DONE.json").write_text(json.dumps({"key": key, "corpus": info}, indent=1))
    shutil.rmtree(data, ignore_errors=True)
    data.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(data)
    log(f"data: {info['train_tokens']} train / {info['heldout_tokens']} held-out tokens in {data}")


def _data_key(spec: PairSpec, tokenizer_from: Path | None = None) -> str:
    """The corpus root is left out: prepared data may move to another machine."""
    fields = ("seed", "corpus_bytes", "heldout_permille", "tokenizer_bytes", "vocab_size")
    values = {f: getattr(spec, f) for f in fields}
    if tokenizer_from is not None:
        values["tokenizer"] = hashlib.sha256((tokenizer_from / "tokenizer.json").read_bytes()).hexdigest()
    blob = json.dumps(values, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]

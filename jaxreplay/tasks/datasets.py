"""Prompt datasets with verifiable answers: local Parquet / JSONL files, or TFDS.

Every source reduces to (prompt, answer) records per split. Local files need no
TensorFlow: `task.path` is a pattern with `{split}` (glob wildcards allowed, so a
Hugging Face Hub repository's shards `data/{split}-*.parquet` are one pattern) or a
directory in a Hub repository's layout. GSM8K and MATH without `task.path` are read
through TFDS, prepared in `task.data_dir` beforehand (the Reverb lane, where
TensorFlow installs). Prompts go through `task.prompt_template` (and the chat
template when `task.chat_template`), are tokenized once at load time, and are
left-padded to the fixed `task.max_prompt_len` so sampling compiles once; a longer
prompt is skipped and counted, or rejected (`task.long_prompts`). Nothing here
downloads. TensorFlow Datasets and pyarrow are imported only by the reader that
needs them.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import logging
import re
from pathlib import Path
from typing import Optional, Protocol, Sequence

import numpy as np

from jaxreplay import storage
from jaxreplay.config import Config, ConfigError, TaskConfig
from jaxreplay.tasks.base import ByteTokenizer, EpochPool, Tokenizer
from jaxreplay.tasks.rewards import REWARDS, get_reward

log = logging.getLogger(__name__)


class DatasetError(ValueError):
    """A dataset that cannot be read as configured; the message names the file, split or field."""


@dataclasses.dataclass(frozen=True)
class Source:
    """Defaults of one `task.name` for the dataset keys left null."""

    prompt_field: str
    answer_field: str
    reward: str
    tfds_name: Optional[str] = None


# MATH has no TFDS builder of its own: prepare the Hendrycks MATH fields (problem,
# solution, level, type) under this name, or set task.tfds_name.
SOURCES = {
    "gsm8k": Source("question", "answer", "gsm8k", "gsm8k"),
    "math": Source("problem", "solution", "math_equivalence", "hendrycks_math"),
    "jsonl": Source("prompt", "answer", "math_equivalence"),
    "parquet": Source("prompt", "answer", "math_equivalence"),
}


def resolved(task: TaskConfig) -> TaskConfig:
    """`task` with its null dataset keys replaced by the source's defaults."""
    source = SOURCES[task.name]
    return dataclasses.replace(task, **{
        key: getattr(source, key) for key in ("prompt_field", "answer_field", "reward", "tfds_name")
        if getattr(task, key) is None
    })


def validate_task_config(c: Config) -> None:
    """The dataset task's part of `config.validate`."""
    t = resolved(c.task)

    def require(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"{key}: {why}")

    require(t.reward in REWARDS, "task.reward", f"{t.reward!r} is not one of {', '.join(sorted(REWARDS))}")
    require(t.train_split != t.eval_split, "task.eval_split",
            f"{t.eval_split!r} is also task.train_split: the eval set must be held out")
    if t.name in ("jsonl", "parquet"):
        require(t.path is not None, "task.path", f"the {t.name} task reads local files: set task.path=DIR or a "
                f"pattern such as data/{{split}}-*.{t.name}")
    if t.path is not None:
        require(("{split}" in t.path) == t.path.endswith(FORMATS), "task.path",
                f"a file pattern with {{split}} ending in {' or '.join(FORMATS)} (e.g. data/{{split}}-*.parquet), "
                f"or a directory in a Hub dataset's layout; got {t.path!r}")
        for key in ("data_dir", "tfds_name"):
            require(getattr(c.task, key) is None, f"task.{key}", "is for TFDS, but task.path reads local files")
    validate_text_prompts(c)


def validate_text_prompts(c: Config) -> None:
    """What every task of text prompts and reference answers needs (datasets, reasoning_gym): no
    warm start (no demonstrations) and a tokenizer the model's vocabulary holds."""
    t = c.task

    def require(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"{key}: {why}")

    require(t.max_prompt_len > 0, "task.max_prompt_len", f"must be positive, got {t.max_prompt_len}")
    require(c.warmstart.steps == 0, "warmstart.steps",
            f"the {t.name} task has no supervised demonstrations: set warmstart.steps=0")
    if c.model.hf_path is None:  # trained from scratch on bytes; an HF tokenizer is checked against its model on load
        require(not t.chat_template, "task.chat_template", "needs a tokenizer with a chat template (model.hf_path)")
        vocab = ByteTokenizer().vocab_size
        require(c.model.vocab_size >= vocab, "model.vocab_size",
                f"{c.model.vocab_size} is smaller than the byte tokenizer's vocabulary ({vocab}): set "
                f"model.hf_path=/path/to/model, or model.vocab_size>={vocab} to train from scratch on bytes")


# ----------------------------------------------------------------------------------
# Readers: (prompt, answer) records of one split


def read_records(task: TaskConfig, split: str) -> list[tuple[str, str]]:
    """The (prompt, answer) records of `split`, in the source's order (shards in shard order)."""
    t = resolved(task)
    fields = (t.prompt_field, t.answer_field)
    if t.path is None:  # gsm8k / math without local files
        return _read_tfds(t.tfds_name, t.data_dir, split, fields)
    records = []
    for path in split_files(t.path, split):
        records += _read_jsonl(path, fields) if path.suffix == ".jsonl" else _read_parquet(path, fields)
    return records


# Local file formats, and where a Hub dataset repository keeps a split's files (the first
# layout present wins; a repository with several configs has one directory per config).
FORMATS = (".parquet", ".jsonl")
HUB_LAYOUTS = ("data/{split}-*.parquet", "{split}-*.parquet", "data/{split}.parquet", "{split}.parquet",
               "data/{split}-*.jsonl", "{split}-*.jsonl", "data/{split}.jsonl", "{split}.jsonl")
_SHARD = re.compile(r"-(\d+)-of-(\d+)(?:-[0-9a-f]+)?\.\w+$")  # train-00001-of-00004[-<hash>].parquet


def split_files(path: str, split: str) -> list[Path]:
    """The files of `split`, sorted: `path` with `{split}` filled in and globbed, or a Hub
    repository's (or one config's) directory. An incomplete set of shards is an error."""
    path = _staged(path)
    pattern = path.replace("{split}", split) if "{split}" in path else _hub_pattern(Path(path), split)
    files = sorted(Path(f) for f in glob.glob(pattern))
    if not files:
        raise DatasetError(f"no file for split {split!r}: {pattern}")
    for f in files:
        if f.suffix not in FORMATS:
            raise DatasetError(f"{f}: not a {' or '.join(FORMATS)} file (task.path {pattern})")
    shards = [_SHARD.search(f.name) for f in files]
    totals = {int(m.group(2)) for m in shards if m}
    found = sorted(int(m.group(1)) for m in shards if m)
    if len(totals) > 1 or (totals and found != list(range(next(iter(totals))))):
        raise DatasetError(f"split {split!r}: shards {found} of {sorted(totals)} in {pattern}: an incomplete or "
                           f"mixed download; fetch the split again")
    return files


def _staged(path: str) -> str:
    """A bucket's `task.path` as a local one: the directory above its first wildcard, copied to the cache."""
    if not storage.is_url(path):
        return path
    wild = min((i for i, ch in enumerate(path) if ch in "{*?["), default=len(path))
    base = path[:wild].rstrip("/") if wild == len(path) else path[:wild].rsplit("/", 1)[0]
    try:
        return str(storage.staged(base)) + path[len(base):]
    except FileNotFoundError:
        raise DatasetError(f"task.path {path}: nothing in the bucket at {base}") from None


def _hub_pattern(root: Path, split: str) -> str:
    if not root.is_dir():
        raise DatasetError(f"task.path {root}: no such directory (nor a file pattern with {{split}})")
    for layout in HUB_LAYOUTS:
        pattern = str(root / layout.replace("{split}", split))
        if glob.glob(pattern):
            return pattern
    configs = sorted(d.name for d in root.iterdir() if d.is_dir() and glob.glob(str(d / f"{split}-*.parquet")))
    if configs:
        raise DatasetError(f"{root} holds the configs {', '.join(configs)}: set task.path to one of them, "
                           f"e.g. {root / configs[0]}")
    raise DatasetError(f"no {split!r} split in {root}: no {split}.parquet, {split}-*.parquet, {split}.jsonl or "
                       f"{split}-*.jsonl there or under data/")


def _text(value, where: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DatasetError(f"{where}: binary data where text is expected (not UTF-8: byte "
                               f"{value[e.start]:#04x} at offset {e.start})") from None
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise DatasetError(f"{where}: expected text or a number, got {type(value).__name__}")


def _read_jsonl(path: Path, fields: tuple[str, str]) -> list[tuple[str, str]]:
    """Lines are decoded one at a time, so that a bad byte or a bad line is named by its line number."""
    records = []
    try:
        f = path.open("rb")
    except OSError as e:
        raise DatasetError(f"{path}: cannot read: {e.strerror}") from None
    with f:
        for n, raw in enumerate(_lines(f, path), 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{path}:{n}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                                   f"{e.start + 1})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{n}: not a JSON object ({e.msg})") from None
            except RecursionError:  # json's decoder recurses once per level of nesting
                raise DatasetError(f"{path}:{n}: JSON nested too deeply to read") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{n}: not a JSON object")
            for key in fields:
                if key not in row:
                    raise DatasetError(f"{path}:{n}: no field {key!r} (fields: {', '.join(sorted(row))}); "
                                       f"set task.prompt_field / task.answer_field")
            records.append((_text(row[fields[0]], f"{path}:{n}"), _text(row[fields[1]], f"{path}:{n}")))
    return records


def _lines(f, path: Path):
    """The lines of binary file `f`; a read error (an I/O error, a directory) names `path`."""
    try:
        yield from f
    except OSError as e:
        raise DatasetError(f"{path}: cannot read: {e.strerror}") from None


def _read_parquet(path: Path, fields: tuple[str, str]) -> list[tuple[str, str]]:
    import pyarrow
    import pyarrow.parquet as pq

    try:  # a damaged or foreign file raises ArrowInvalid (a ValueError), an unreadable one OSError
        names = pq.read_schema(path).names
        for key in fields:
            if key not in names:
                raise DatasetError(f"{path}: no column {key!r} (columns: {', '.join(names)}); "
                                   f"set task.prompt_field / task.answer_field")
        columns = pq.read_table(path, columns=list(fields)).to_pydict()
    except (pyarrow.ArrowException, OSError) as e:
        raise DatasetError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    return [(_text(p, f"{path}: row {i}"), _text(a, f"{path}: row {i}"))
            for i, (p, a) in enumerate(zip(columns[fields[0]], columns[fields[1]]))]


def _read_tfds(name: str, data_dir: Optional[str], split: str, fields: tuple[str, str]) -> list[tuple[str, str]]:
    """Reads a prepared split; never downloads (a missing dataset is an error, not a fetch)."""
    from jaxreplay.compat import set_tf_cpu_only  # TFDS runs TensorFlow: keep it off the GPUs JAX uses

    if importlib.util.find_spec("tensorflow_datasets") is None:
        raise DatasetError(f"reading {name!r} through TFDS needs tensorflow-datasets (the reverb extra), not installed "
                           f"here: set task.path to the dataset's Parquet or JSONL files instead")
    set_tf_cpu_only()
    import tensorflow_datasets as tfds

    where = data_dir or "TFDS's default data_dir"
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError:
        raise DatasetError(f"TFDS dataset {name!r} is neither a TFDS builder nor prepared in {where}") from None
    if not builder.is_prepared():
        raise DatasetError(f"TFDS dataset {name!r} is not prepared in {where}: run `tfds build {name} "
                           f"--data_dir DIR` where the network is reachable, then set task.data_dir=DIR")
    if split not in builder.info.splits:
        raise DatasetError(f"TFDS dataset {name!r} has no split {split!r} (splits: "
                           f"{', '.join(sorted(builder.info.splits))})")
    features = builder.info.features
    for key in fields:
        if key not in features:
            raise DatasetError(f"TFDS dataset {name!r} has no feature {key!r} (features: "
                               f"{', '.join(sorted(features))}); set task.prompt_field / task.answer_field")
    dataset = builder.as_dataset(split=split, shuffle_files=False)
    where = f"{name}/{split}"
    return [(_text(row[fields[0]], f"{where}: row {i}"), _text(row[fields[1]], f"{where}: row {i}"))
            for i, row in enumerate(tfds.as_numpy(dataset))]


# ----------------------------------------------------------------------------------
# The task


class PromptTokenizer(Tokenizer, Protocol):
    def encode_prompt(self, text: str, *, chat: bool) -> list[int]:
        """Prompt ids with the tokenizer's own BOS, through the chat template when `chat`."""
        ...


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt with its reference answer; `ids` is the tokenized prompt."""

    index: int  # position in its split
    prompt: str
    answer: str
    ids: tuple[int, ...]


class DatasetTask:
    """A dataset split as a `Task`: a seeded, epoch-shuffled training stream and a fixed eval set."""

    def __init__(self, config: TaskConfig, tokenizer: PromptTokenizer, *,
                 records: Optional[dict[str, Sequence[tuple[str, str]]]] = None, train: bool = True):
        """`records` (split -> (prompt, answer) pairs) replaces reading the configured source.
        `train=False` reads the eval split alone (for evaluation, which never draws a training problem)."""
        self.config = resolved(config)
        self.tokenizer = tokenizer
        self.prompt_len = self.config.max_prompt_len
        self.reward_fn = get_reward(self.config.reward)
        self.skipped: dict[str, int] = {}
        c = self.config
        read = (lambda split: records[split]) if records is not None else (lambda split: read_records(c, split))
        examples = self._encode(c.train_split, read(c.train_split)) if train or c.validation_size else []
        self.eval_problems = self._encode(c.eval_split, read(c.eval_split))[:c.eval_size]
        self.train_examples, self.validation_problems = [], []
        if examples:
            if c.validation_size:
                if c.validation_size >= len(examples):
                    raise DatasetError(f"task.validation_size={c.validation_size} would take all {len(examples)} "
                                       f"usable examples of split {c.train_split!r}, leaving none to train on")
                examples, self.validation_problems = (examples[:-c.validation_size],
                                                      examples[-c.validation_size:])
            self.train_examples = examples[:c.train_size] if c.train_size else examples
        self._pool = EpochPool(self.train_examples) if self.train_examples else None

    def _encode(self, split: str, records: Sequence[tuple[str, str]]) -> list[Example]:
        c = self.config
        out, too_long = [], []
        for i, (prompt, answer) in enumerate(records):
            text = c.prompt_template.replace("{prompt}", prompt)
            ids = tuple(self.tokenizer.encode_prompt(text, chat=c.chat_template))
            if len(ids) > self.prompt_len:
                too_long.append((i, len(ids)))
                continue
            out.append(Example(i, prompt, answer, ids))
        if too_long and c.long_prompts == "error":
            i, n = too_long[0]
            raise DatasetError(f"split {split!r}, record {i}: prompt of {n} tokens exceeds task.max_prompt_len="
                               f"{self.prompt_len} ({len(too_long)} such prompts; task.long_prompts=skip drops them)")
        self.skipped[split] = len(too_long)
        if too_long:
            log.warning("split %r: skipped %d of %d prompts longer than task.max_prompt_len=%d", split,
                        len(too_long), len(records), self.prompt_len)
        if not out:
            raise DatasetError(f"split {split!r} has no usable prompt ({len(records)} records, {len(too_long)} "
                               f"longer than task.max_prompt_len={self.prompt_len})")
        return out

    def train_problems(self, seed: int, index: int, n: int) -> list[Example]:
        """Batch `index` of the stream: each epoch visits every training example once, in a
        seeded order, so the stream is a pure function of (seed, index)."""
        if self._pool is None:
            raise RuntimeError("this task was made for evaluation only (train=False): it has no training split")
        return self._pool.batch(seed, index, n)

    def encode_prompts(self, problems: Sequence[Example]) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.full((len(problems), self.prompt_len), self.tokenizer.pad_id, np.int32)
        mask = np.zeros((len(problems), self.prompt_len), bool)
        for i, p in enumerate(problems):
            tokens[i, self.prompt_len - len(p.ids):] = p.ids
            mask[i, self.prompt_len - len(p.ids):] = True
        return tokens, mask

    def reward(self, problem: Example, completion_ids: Sequence[int]) -> float:
        return float(self.reward_fn(self.tokenizer.decode(completion_ids), problem.answer))

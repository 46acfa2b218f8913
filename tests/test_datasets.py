"""Dataset tasks: GSM8K, MATH and OpenR1-Math-style sets from local Parquet files in the Hugging Face Hub's
layouts or JSONL (no TensorFlow), or through TFDS from a data_dir (never downloaded); configurable fields,
fixed-length prompts, a seeded stream, and counted reward errors."""

import importlib.util
import json
import logging

import numpy as np
import pytest

from jaxreplay.config import ConfigError, load_config
from jaxreplay.tasks import rewards as rewards_module
from jaxreplay.tasks.base import ByteTokenizer, score
from jaxreplay.tasks.datasets import DatasetError, DatasetTask
from jaxreplay.tasks.registry import make_task

GSM8K = {
    "train": [
        ("Tom has 3 apples and buys 4 more. How many apples does he have?", "3 + 4 = <<3+4=7>>7\n#### 7"),
        ("A pen costs $2. How much do 5 pens cost?", "5 * 2 = <<5*2=10>>10\n#### 10"),
        ("Sam reads 12 pages a day. How many pages in 3 days?", "12 * 3 = 36\n#### 36"),
        ("There are 1,000 ants and 250 leave. How many stay?", "1000 - 250 = 750\n#### 750"),
        ("Half of 30 birds fly away. How many remain?", "30 / 2 = 15\n#### 15"),
    ],
    "test": [
        ("Ann has 9 cards and gives away 4. How many are left?", "9 - 4 = 5\n#### 5"),
        ("A box holds 6 eggs. How many eggs in 7 boxes?", "6 * 7 = 42\n#### 42"),
    ],
}
MATH = {
    "train": [
        (r"Compute $\frac{1}{2} + \frac{1}{4}$.", r"We get $\frac{2}{4} + \frac{1}{4} = \boxed{\frac{3}{4}}$."),
        (r"Solve $2x = 3$.", r"Dividing, $x = \boxed{\dfrac{3}{2}}$."),
        (r"What is $\sqrt{16}$?", r"$\sqrt{16} = \boxed{4}$."),
    ],
    "test": [
        (r"Find the point $(1+1, 3)$.", r"It is $\boxed{\left( 2, 3 \right)}$."),
    ],
}


def _prepare(data_dir, name, features, data, convert):
    """Prepares `data` as the TFDS dataset `name` in `data_dir`, as `tfds build` would."""
    import tensorflow_datasets as tfds

    class Fixture(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self, features=tfds.features.FeaturesDict({k: tfds.features.Text() for k in features}))

        def _split_generators(self, dl_manager):
            return {split: self._generate_examples(split) for split in data}

        def _generate_examples(self, split):
            for i, (prompt, answer) in enumerate(data[split]):
                yield i, convert(prompt, answer)

    Fixture.name = name
    tfds.disable_progress_bar()
    Fixture(data_dir=str(data_dir)).download_and_prepare(
        download_config=tfds.download.DownloadConfig(try_download_gcs=False))


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    """GSM8K in TFDS's own feature layout (the registered `gsm8k` builder reads it back) and MATH's
    fields under `hendrycks_math` (no registered builder: TFDS reads it from the files)."""
    pytest.importorskip("tensorflow_datasets", reason="TFDS needs TensorFlow (the `reverb` extra; Python 3.10/3.11)")
    data_dir = tmp_path_factory.mktemp("tfds")
    _prepare(data_dir, "gsm8k", ["question", "answer", "annotation", "short_answer"], GSM8K,
             lambda q, a: {"question": q, "answer": a, "annotation": a.split("####")[0],
                           "short_answer": a.split("#### ")[1]})
    _prepare(data_dir, "hendrycks_math", ["problem", "solution", "level", "type"], MATH,
             lambda p, s: {"problem": p, "solution": s, "level": "Level 1", "type": "Algebra"})
    return data_dir


DATASET = ["warmstart.steps=0", "model.vocab_size=260", "model.max_seq_len=200", "task.max_prompt_len=128"]


def config(*overrides):
    return load_config(None, [*DATASET, *overrides])


def completion_ids(text: str) -> list[int]:
    tok = ByteTokenizer()
    return tok.encode(text) + [tok.eos_id]


@pytest.mark.needs_tf
def test_gsm8k_reads_the_prepared_tfds_split_and_scores_final_answers(tfds_dir):
    task = make_task(config("task.name=gsm8k", f"task.data_dir={tfds_dir}").task)
    # TFDS stores examples in its own (fixed) order.
    assert sorted((p.prompt, p.answer) for p in task.eval_problems) == sorted(GSM8K["test"])
    assert sorted((p.prompt, p.answer) for p in task.train_examples) == sorted(GSM8K["train"])
    first = next(p for p in task.eval_problems if p.prompt.startswith("Ann"))  # 9 - 4 = 5
    assert task.reward(first, completion_ids("She gives away 4, so 9 - 4 = 5.\n#### 5")) == 1.0
    assert task.reward(first, completion_ids(r"The answer is $\boxed{5}$")) == 1.0
    assert task.reward(first, completion_ids("#### 6")) == 0.0


@pytest.mark.needs_tf
def test_math_reads_a_prepared_dataset_without_a_registered_builder(tfds_dir):
    task = make_task(config("task.name=math", f"task.data_dir={tfds_dir}").task)
    assert [p.prompt for p in task.eval_problems] == [MATH["test"][0][0]]
    point = task.eval_problems[0]
    assert task.reward(point, completion_ids(r"so \boxed{(2,3)}")) == 1.0
    assert task.reward(point, completion_ids(r"so \boxed{[2,3]}")) == 0.0
    half = next(p for p in task.train_examples if "2x" in p.prompt)
    assert task.reward(half, completion_ids(r"x = \boxed{1.5}")) == 1.0


@pytest.mark.needs_tf
def test_an_unprepared_tfds_dataset_is_an_error_never_a_download(tmp_path):
    pytest.importorskip("tensorflow_datasets", reason="TFDS needs TensorFlow (the `reverb` extra; Python 3.10/3.11)")
    with pytest.raises(DatasetError, match=r"'gsm8k' is not prepared in .*tfds build gsm8k"):
        make_task(config("task.name=gsm8k", f"task.data_dir={tmp_path}").task)
    with pytest.raises(DatasetError, match="'no_such_set' is neither a TFDS builder nor prepared"):
        make_task(config("task.name=math", "task.tfds_name=no_such_set", f"task.data_dir={tmp_path}").task)


@pytest.mark.needs_tf
def test_tfds_errors_name_the_missing_split_or_feature(tfds_dir):
    with pytest.raises(DatasetError, match="no split 'validation'"):
        make_task(config("task.name=gsm8k", f"task.data_dir={tfds_dir}", "task.eval_split=validation").task)
    with pytest.raises(DatasetError, match="no feature 'prompt'"):
        make_task(config("task.name=gsm8k", f"task.data_dir={tfds_dir}", "task.prompt_field=prompt").task)


def _write_shards(directory, split, columns, shards=1):
    """`columns` as the Hub publishes a split: {split}-0000i-of-0000n.parquet, rows in shard order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    n = len(next(iter(columns.values())))
    bounds = [n * i // shards for i in range(shards + 1)]
    for i in range(shards):
        part = {k: v[bounds[i]:bounds[i + 1]] for k, v in columns.items()}
        pq.write_table(pa.table(part), directory / f"{split}-{i:05d}-of-{shards:05d}.parquet")


def _gsm8k_repo(root):
    """openai/gsm8k's layout: one directory per config ({config}/{split}-*.parquet); train in two shards."""
    for config in ("main", "socratic"):
        for split, rows in GSM8K.items():
            _write_shards(root / config, split, {"question": [q for q, _ in rows], "answer": [a for _, a in rows]},
                          shards=2 if split == "train" else 1)
    return root


def _math_repo(root):
    """A MATH repository's default layout (data/{split}-*.parquet) with MATH's columns."""
    for split, rows in MATH.items():
        _write_shards(root / "data", split, {"problem": [p for p, _ in rows], "level": ["Level 1"] * len(rows),
                                             "solution": [s for _, s in rows], "type": ["Algebra"] * len(rows)},
                      shards=3 if split == "train" else 1)
    return root


@pytest.mark.parametrize("path", ["{root}/main", "{root}/main/{{split}}-*.parquet"])
def test_gsm8k_from_the_hub_repository_parquet_layout(tmp_path, path):
    """A config's directory or an explicit shard pattern; shards are read in order, scored like TFDS's GSM8K."""
    root = _gsm8k_repo(tmp_path / "gsm8k")
    task = make_task(config("task.name=gsm8k", f"task.path={path.format(root=root)}").task)
    assert [(p.prompt, p.answer) for p in task.train_examples] == GSM8K["train"]
    assert [(p.prompt, p.answer) for p in task.eval_problems] == GSM8K["test"]
    first = task.eval_problems[0]  # 9 - 4 = 5
    assert task.reward(first, completion_ids("She gives away 4, so 9 - 4 = 5.\n#### 5")) == 1.0
    assert task.reward(first, completion_ids(r"The answer is $\boxed{5}$")) == 1.0
    assert task.reward(first, completion_ids("#### 6")) == 0.0


def test_math_from_a_repository_directory_in_the_data_layout(tmp_path):
    task = make_task(config("task.name=math", f"task.path={_math_repo(tmp_path / 'math')}").task)
    assert [(p.prompt, p.answer) for p in task.train_examples] == MATH["train"]
    point = task.eval_problems[0]
    assert task.reward(point, completion_ids(r"so \boxed{(2,3)}")) == 1.0
    assert task.reward(point, completion_ids(r"so \boxed{[2,3]}")) == 0.0
    half = next(p for p in task.train_examples if "2x" in p.prompt)
    assert task.reward(half, completion_ids(r"x = \boxed{1.5}")) == 1.0


def test_an_openr1_math_style_set_with_bare_answers(tmp_path):
    """OpenR1-Math's columns (problem, a long solution, the bare answer that is scored against), each split
    written as one {split}.parquet, as `datasets`' to_parquet leaves it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = {"train": [(r"Compute $\frac{1}{2} + \frac{1}{4}$.", r"\frac{3}{4}"), ("What is $2^5$?", "32")],
            "test": [("Solve $2x = 3$.", r"\dfrac{3}{2}")]}
    for split, records in rows.items():
        pq.write_table(pa.table({"problem": [p for p, _ in records], "solution": ["Long reasoning ..."] * len(records),
                                 "answer": [a for _, a in records], "uuid": [str(i) for i in range(len(records))]}),
                       tmp_path / f"{split}.parquet")
    task = make_task(config("task.name=parquet", f"task.path={tmp_path}", "task.prompt_field=problem",
                            "task.answer_field=answer").task)
    assert [(p.prompt, p.answer) for p in task.train_examples] == rows["train"]
    assert task.config.reward == "math_equivalence"
    assert task.reward(task.train_examples[0], completion_ids(r"so \boxed{0.75}")) == 1.0
    assert task.reward(task.eval_problems[0], completion_ids(r"x = \boxed{1.5}")) == 1.0
    assert task.reward(task.eval_problems[0], completion_ids(r"x = \boxed{2}")) == 0.0


def test_gsm8k_from_jsonl_files_and_a_repository_of_jsonl(tmp_path):
    """JSONL as {split}.jsonl by pattern, and a repository keeping {split}.jsonl at its root (MATH-500's layout)."""
    for split, rows in GSM8K.items():
        (tmp_path / f"{split}.jsonl").write_text(
            "".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    for path in (f"{tmp_path}/{{split}}.jsonl", str(tmp_path)):
        task = make_task(config("task.name=gsm8k", f"task.path={path}").task)
        assert [(p.prompt, p.answer) for p in task.eval_problems] == GSM8K["test"]
        assert task.reward(task.eval_problems[1], completion_ids("7 boxes: 42 eggs\n#### 42")) == 1.0


def test_repository_errors_name_the_configs_missing_shards_or_split(tmp_path):
    root = _gsm8k_repo(tmp_path / "gsm8k")
    with pytest.raises(DatasetError, match=r"holds the configs main, socratic: set task.path to one of them"):
        make_task(config("task.name=gsm8k", f"task.path={root}").task)
    (root / "main" / "train-00001-of-00002.parquet").unlink()  # an interrupted download
    with pytest.raises(DatasetError, match=r"split 'train': shards \[0\] of \[2\] .*incomplete"):
        make_task(config("task.name=gsm8k", f"task.path={root}/main").task)
    with pytest.raises(DatasetError, match=r"no 'validation' split in .*socratic: no validation\.parquet"):
        make_task(config("task.name=gsm8k", f"task.path={root}/socratic", "task.eval_split=validation").task)
    with pytest.raises(DatasetError, match=r"no file for split 'train': .*nowhere/train-\*\.parquet"):
        make_task(config("task.name=gsm8k", f"task.path={tmp_path}/nowhere/{{split}}-*.parquet").task)
    with pytest.raises(DatasetError, match=r"task.path .*nowhere: no such directory"):
        make_task(config("task.name=gsm8k", f"task.path={tmp_path}/nowhere").task)


def test_gsm8k_without_files_needs_tfds_and_says_so(tmp_path):
    if importlib.util.find_spec("tensorflow_datasets") is not None:
        pytest.skip("TFDS is installed here (the Reverb lane): the TFDS tests read it")
    with pytest.raises(DatasetError, match="needs tensorflow-datasets .* set task.path to the dataset's Parquet"):
        make_task(config("task.name=gsm8k", f"task.data_dir={tmp_path}").task)


@pytest.mark.needs_tf
def test_parquet_and_tfds_give_the_same_records(tfds_dir, tmp_path):
    """Where TFDS installs, the Hub's Parquet files and the prepared TFDS dataset are the same task."""
    hub = make_task(config("task.name=gsm8k", f"task.path={_gsm8k_repo(tmp_path)}/main").task)
    tfds = make_task(config("task.name=gsm8k", f"task.data_dir={tfds_dir}").task)
    for split in ("train_examples", "eval_problems"):
        assert sorted((p.prompt, p.answer, p.ids) for p in getattr(hub, split)) == \
            sorted((p.prompt, p.answer, p.ids) for p in getattr(tfds, split))
    assert hub.config.reward == tfds.config.reward == "gsm8k"


def _write_files(tmp_path, data, fields=("q", "sol")):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for split, rows in data.items():
        with open(tmp_path / f"{split}.jsonl", "w") as f:
            for prompt, answer in rows:
                f.write(json.dumps({fields[0]: prompt, fields[1]: answer, "id": 1}) + "\n\n")
        columns = {fields[0]: [p for p, _ in rows], fields[1]: [a for _, a in rows]}
        pq.write_table(pa.table(columns), tmp_path / f"{split}.parquet")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_local_files_with_configurable_fields(tmp_path, fmt):
    _write_files(tmp_path, MATH)
    task = make_task(config(f"task.name={fmt}", f"task.path={tmp_path}/{{split}}.{fmt}", "task.prompt_field=q",
                            "task.answer_field=sol").task)
    assert [(p.prompt, p.answer) for p in task.train_examples] == MATH["train"]
    assert [(p.prompt, p.answer) for p in task.eval_problems] == MATH["test"]
    with pytest.raises(DatasetError, match="no (field|column) 'prompt'"):
        make_task(config(f"task.name={fmt}", f"task.path={tmp_path}/{{split}}.{fmt}").task)


def test_malformed_jsonl_names_the_line(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", \n')
    (tmp_path / "test.jsonl").write_text('{"prompt": "a", "answer": "1"}\n')
    with pytest.raises(DatasetError, match=r"train\.jsonl:2: not a JSON object"):
        make_task(config("task.name=jsonl", f"task.path={tmp_path}/{{split}}.jsonl").task)
    (tmp_path / "train.jsonl").write_text('{"prompt": "a", "answer": "1"}\n')
    with pytest.raises(DatasetError, match=r"no file for split 'validation': .*validation\.jsonl"):
        make_task(config("task.name=jsonl", f"task.path={tmp_path}/{{split}}.jsonl", "task.eval_split=validation").task)


def _task(records, *overrides):
    return DatasetTask(config("task.name=jsonl", "task.path=unused/{split}.jsonl", *overrides).task, ByteTokenizer(),
                       records=records)


def test_prompts_go_through_the_template_and_are_left_padded_to_max_prompt_len():
    task = _task({"train": [("ab", "1")], "test": [("xyz", "2")]}, "task.max_prompt_len=48",
                 r"task.prompt_template={prompt} Put the answer in \boxed{}.")
    tokens, mask = task.encode_prompts(task.eval_problems)
    assert tokens.shape == mask.shape == (1, 48) and task.prompt_len == 48
    text = "xyz Put the answer in \\boxed{}."
    assert ByteTokenizer().decode(tokens[0][mask[0]]) == text
    n = 1 + len(text)  # BOS + bytes
    assert mask[0].tolist() == [False] * (48 - n) + [True] * n


def test_prompts_longer_than_max_prompt_len_are_skipped_and_counted_or_rejected(caplog):
    records = {"train": [("short", "1"), ("x" * 40, "2"), ("tiny", "3")], "test": [("ok", "1")]}
    with caplog.at_level(logging.WARNING):
        task = _task(records, "task.max_prompt_len=16")
    assert [p.prompt for p in task.train_examples] == ["short", "tiny"]
    assert task.skipped == {"train": 1, "test": 0}
    assert "skipped 1 of 3 prompts" in caplog.text
    with pytest.raises(DatasetError, match="split 'train', record 1: prompt of 41 tokens exceeds task.max_prompt_len"):
        _task(records, "task.max_prompt_len=16", "task.long_prompts=error")
    with pytest.raises(DatasetError, match="split 'test' has no usable prompt"):
        _task({"train": [("a", "1")], "test": [("y" * 40, "1")]}, "task.max_prompt_len=16")


def test_train_stream_is_a_seeded_pure_function_and_each_epoch_visits_every_example():
    task = _task({"train": [(f"p{i}", str(i)) for i in range(10)], "test": [("q", "0")]})
    assert task.train_problems(0, 3, 4) == task.train_problems(0, 3, 4)
    assert task.train_problems(0, 3, 4) != task.train_problems(1, 3, 4)
    stream = [p.index for i in range(5) for p in task.train_problems(7, i, 4)]  # 20 draws = 2 epochs
    assert sorted(stream[:10]) == sorted(stream[10:]) == list(range(10))
    assert stream[:10] != stream[10:]  # a fresh order each epoch


def test_eval_size_caps_the_eval_set_in_file_order():
    task = _task({"train": [("a", "1")], "test": [(f"q{i}", "1") for i in range(9)]}, "task.eval_size=4")
    assert [p.prompt for p in task.eval_problems] == ["q0", "q1", "q2", "q3"]


def test_a_reward_function_that_raises_is_counted_not_fatal(monkeypatch, caplog):
    def fragile(completion, reference):
        if "boom" in completion:
            raise ZeroDivisionError("bad input")
        return float(completion == reference)

    monkeypatch.setitem(rewards_module.REWARDS, "fragile", fragile)
    task = _task({"train": [("a", "1")], "test": [("q", "7")]}, "task.reward=fragile")
    completions = np.array([(completion_ids(t) + [0] * 6)[:6] for t in ["7", "boom", "8", "boom"]])
    with caplog.at_level(logging.WARNING):
        rewards, errors = score(task, task.eval_problems * 4, completions)
    assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0] and errors == 2
    assert "ZeroDivisionError: bad input" in caplog.text


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["task.name=jsonl", "task.path=data/train.jsonl"], "task.path"),  # no {split}: train and eval would coincide
        (["task.name=jsonl"], "task.path"),
        (["task.name=parquet", "task.path=data/{split}.csv"], "task.path"),  # neither .parquet nor .jsonl
        (["task.name=parquet", "task.path=data/{split}-*"], "task.path"),
        (["task.name=gsm8k", "task.path=data/gsm8k", "task.data_dir=tfds"], "task.data_dir"),
        (["task.name=math", "task.path=data/{split}.jsonl", "task.tfds_name=hendrycks_math"], "task.tfds_name"),
        (["task.name=gsm8k", "task.reward=nope"], "task.reward"),
        (["task.name=gsm8k", "task.eval_split=train"], "task.eval_split"),
        (["task.name=gsm8k", "warmstart.steps=10"], "warmstart.steps"),
        (["task.name=gsm8k", "model.vocab_size=128"], "model.vocab_size"),
        (["task.name=gsm8k", "task.chat_template=true"], "task.chat_template"),
        (["task.name=gsm8k", "task.max_prompt_len=0"], "task.max_prompt_len"),
        (["task.name=gsm8k", "model.max_seq_len=100"], "model.max_seq_len"),
        (["task.long_prompts=drop"], "task.long_prompts"),
        (["task.reward=gsm8k"], "task.reward"),  # arithmetic scores with its own exact match
    ],
)
def test_bad_dataset_settings_are_config_errors_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, [*DATASET, *overrides])


def test_a_hugging_face_tokenizer_and_its_chat_template(tmp_path):
    """Prompts go through the model's chat template; completions are decoded up to its EOS."""
    from tiny_hf import write_model

    from jaxreplay.models.tokenizer import load_tokenizer

    write_model(tmp_path)
    tok = load_tokenizer(tmp_path)
    records = {"train": [("1+1?", "2")], "test": [("2+3?", "5")]}
    task = DatasetTask(config("task.name=jsonl", "task.path=x/{split}.jsonl", "task.chat_template=true",
                              f"model.hf_path={tmp_path}",
                              r"task.prompt_template={prompt} Box it.").task, tok, records=records)
    tokens, mask = task.encode_prompts(task.eval_problems)
    chat = tok.chat_prompt("2+3? Box it.")
    assert chat == "<|im_start|>user\n2+3? Box it.<|im_end|>\n<|im_start|>assistant\n"
    assert tokens[0][mask[0]].tolist() == tok.encode(chat)
    assert (tokens[0][~mask[0]] == tok.pad_id).all()
    answer = tok.encode(r"so \boxed{5}") + [tok.eos_id] + tok.encode(r" \boxed{6}")
    assert task.reward(task.eval_problems[0], answer) == 1.0  # what follows EOS is not read


@pytest.mark.slow
def test_training_on_a_jsonl_dataset_end_to_end(tmp_path, monkeypatch):
    """A byte-level model trained from scratch on a JSONL dataset through the real loop and Reverb table,
    with a reward function that raises on about half the completions: counted, and the run goes on."""
    from jaxreplay.train.driver import train
    from jaxreplay.train.metrics import read_metrics

    def fragile(completion, reference):
        if not completion or ord(completion[0]) % 2:
            raise ValueError("cannot parse")
        return rewards_module.exact_match(completion, reference)

    monkeypatch.setitem(rewards_module.REWARDS, "fragile", fragile)

    rows = {"train": [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)],
            "test": [(f"{a}+{b}=", str(a + b)) for a, b in [(1, 2), (3, 4), (5, 5), (9, 0)]]}
    for split, records in rows.items():
        (tmp_path / f"{split}.jsonl").write_text(
            "".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in records))
    cfg = load_config(None, [
        "task.name=jsonl", f"task.path={tmp_path}/{{split}}.jsonl", "task.reward=fragile",
        "task.max_prompt_len=8", "warmstart.steps=0", "model.vocab_size=259", "model.d_model=32",
        "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16", "model.d_ff=64",
        "model.max_seq_len=12", "sampling.max_new_tokens=3", "train.batch_size=16", "train.prompts_per_step=4",
        "train.group_size=4", "train.steps=3", "train.eval_every=3", "replay.max_size=64",
        "replay.min_size_to_sample=16", "checkpoint.every=3", "run.progress_bar=false", f"run.dir={tmp_path / 'run'}",
    ])
    summary = train(cfg, log=lambda _: None)
    records = read_metrics(cfg.run.dir)
    assert summary["steps"] == 3 and [r["step"] for r in records] == [0, 1, 2, 3]
    errors = [r["reward/errors"] for r in records[1:]]
    assert all(0 <= e <= 16 for e in errors) and sum(errors) > 0
    assert records[-1]["tokens/generated"] > 0 and "eval/accuracy" in records[-1]
